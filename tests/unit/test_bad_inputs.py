"""One table of bad inputs: each gives a clear error naming the problem, before any compute.

Every row is (id, where the input enters, the input, the exception or exit code, a regex the
message must match). Entry points, all public:

* `cli`: `flashcp train CONFIG OVERRIDES` (`flashcp.cli.main`) with an environment; the job is
  never launched (`launch_command` would fail the test) and the output directory holds nothing
  but, at most, a log.
* `worker`: one rank of a launched job (`flashcp.train.main`) under a fake launcher environment;
  it must return before the distributed runtime starts (`init_distributed` would fail the test).
* `call`: a library call (masks, attention, CP attention, dispatch, fault specs); the kernel and
  the FlashAttention dispatch must not be reached (both replaced by failing stand-ins).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

import flashcp.distributed
import flashcp.train
from flashcp import cli as flashcp_cli
from flashcp import dispatch, masks
from flashcp.attention import flashmask_attention
from flashcp.cp import flashmask_attention_cp
from flashcp.kernels import registry
from flashcp.trainer import faults, job

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "gpt" / "tiny_cp2.yaml")
PORT = "@port"
"""Placeholder in a row's environment: a port some socket is listening on."""


@dataclass(frozen=True)
class Row:
    """One bad input and what it must produce."""

    id: str
    entry: str
    """`cli`, `worker` or `call`."""
    args: Any
    """cli/worker: overrides (`{tmp}` is the test's directory); call: a zero-argument callable."""
    expect: type[BaseException] | int
    """The exception (call) or exit code (cli, worker)."""
    match: str
    """Regex the error message must match."""
    env: dict[str, str] = field(default_factory=dict)
    config: str | None = None
    """cli/worker: config file text (written to `{tmp}/config.yaml`), `missing`, or the tiny
    GPT config when None."""


# -- inputs for `call` rows -------------------------------------------------------------------


def _idx(*shape: int, fill: int = 0, dtype: Any = np.int32, at: tuple | None = None,
         value: int = 0) -> np.ndarray:  # fmt: skip
    out = np.full(shape, fill, dtype=dtype)
    if at is not None:
        out[at] = value
    return out


def _validate(idx: np.ndarray, **kw: Any) -> Callable[[], Any]:
    return lambda: masks.validate(idx, **kw)


def _qkv(
    hq: int = 4, hkv: int = 2, s: int = 8, d: int = 8, dtype: str = "float32", b: int = 2
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    rng = np.random.default_rng(0)
    return tuple(
        paddle.to_tensor(rng.standard_normal((b, s, h, d)).astype("float32")).astype(dtype)
        for h in (hq, hkv, hkv)
    )


def _attn(
    q_: dict | None = None,
    k_: dict | None = None,
    mask: np.ndarray | None = None,
    **kw: Any,
) -> Callable[[], Any]:
    def call() -> Any:
        q, _, _ = _qkv(**(q_ or {}))
        _, k, v = _qkv(**(k_ or {}))
        m = None if mask is None else paddle.to_tensor(mask)
        return flashmask_attention(q, k, v, m, causal=kw.pop("causal", True), **kw)

    return call


def _cp(q_: dict | None = None, k_: dict | None = None, mask: Any = "causal",
        **kw: Any) -> Callable[[], Any]:  # fmt: skip
    def call() -> Any:
        q, _, _ = _qkv(**(q_ or {}))
        _, k, v = _qkv(**(k_ or {}))
        m = masks.causal_mask(2, 8).indices if isinstance(mask, str) else mask
        return flashmask_attention_cp(q, k, v, m, causal=True, **kw)

    return call


def _explain(requested: Any = 2, policy: str = "error", head_dim: int = 64) -> Callable[[], Any]:
    return lambda: dispatch.explain_fa_version(
        requested,
        fa4_available=False,
        block_mask_api=False,
        deterministic=True,
        head_dim=head_dim,
        fa4_unavailable=policy,
    )


# -- the table --------------------------------------------------------------------------------

E = 2  # exit code of a bad config / a job that cannot launch


def cli(id: str, overrides: list[str], match: str, env: dict[str, str] | None = None,
        config: str | None = None) -> Row:  # fmt: skip
    """`flashcp train CONFIG OVERRIDES` must exit 2 before launching."""
    return Row(id, "cli", overrides, E, match, env or {}, config)


def worker(id: str, env: dict[str, str], match: str, overrides: list[str] | None = None) -> Row:
    """One launched rank (`flashcp/train.py`) must exit 2 before distributed init."""
    return Row(id, "worker", overrides or [], E, match, env)


def call(id: str, fn: Callable[[], Any], exc: type[BaseException], match: str) -> Row:
    """A library call must raise `exc` before the kernel or the dispatch run."""
    return Row(id, "call", fn, exc, match)


W2 = {"PADDLE_TRAINERS_NUM": "2"}

# fmt: off
ROWS = [
    # -- configs: keys, types, values ----------------------------------------------------------
    cli("unknown_key", ["train.stepz=3"],
        r"train\.stepz: unknown key \(did you mean steps\?\)"),
    cli("unknown_section", ["trian.steps=3"],
        r"trian: unknown section \(did you mean train\?\)"),
    cli("type_number", ["train.lr=fast"],
        r"train\.lr: expected a number, got 'fast'"),
    cli("type_integer", ["train.steps=2.5"],
        r"train\.steps: expected an integer, got 2\.5"),
    cli("type_bool", ["train.deterministic=maybe"],
        r"train\.deterministic: expected true or false"),
    cli("bad_cp_mode", ["parallel.cp_mode=ring"],
        r"parallel\.cp_mode: expected one of 'dualchunk_allgather'"),
    cli("seq_len_vs_2cp", ["data.seq_len=250"],
        r"data\.seq_len: 250 is not a multiple of 2·cp = 4"),
    cli("seq_len_vs_4cp_balanced", ["parallel.cp_mode=workload_balanced", "data.seq_len=252"],
        r"data\.seq_len: 252 is not a multiple of 4·cp = 8"),
    cli("seq_len_vs_cp_contiguous", ["parallel.cp_mode=contiguous_allgather", "parallel.cp=3"],
        r"data\.seq_len: 256 is not a multiple of cp = 3"),
    cli("heads_vs_gqa", ["model.num_heads=8", "model.num_kv_heads=3"],
        r"num_heads 8 is not a multiple of num_kv_heads 3"),
    cli("layers_vs_stages", ["parallel.pp=3"],
        r"model\.num_layers: 2 layers cannot fill parallel\.pp = 3 pipeline stages"),
    cli("bad_fa_policy", ["attention.fa4_unavailable=maybe"],
        r"attention\.fa4_unavailable: expected one of 'error', 'fallback', got 'maybe'"),
    cli("bad_on_nonfinite", ["train.on_nonfinite=ignore"],
        r"train\.on_nonfinite: expected one of 'stop', 'skip', got 'ignore'"),
    cli("negative_lr", ["train.lr=-1"],
        r"train\.lr: must be > 0, got -1"),
    cli("min_lr_above_lr", ["train.min_lr=1.0"],
        r"train\.min_lr: 1\.0 is above train\.lr"),
    cli("zero_dp", ["parallel.dp=0"],
        r"parallel\.dp: must be an integer >= 1, got 0"),
    cli("zero_micro_batch", ["data.micro_batch_size=0"],
        r"data\.micro_batch_size: must be >= 1"),
    cli("vocab_vs_tokenizer", ["model.vocab_size=100"],
        r"model\.vocab_size: 100 is smaller than the byte tokenizer"),
    cli("seq_len_vs_max", ["data.seq_len=4096"],
        r"data\.seq_len 4096 exceeds model\.max_seq_len 256"),
    cli("bf16_on_cpu", ["train.dtype=bfloat16", "run.device=cpu"],
        r"train\.dtype: bfloat16 needs a GPU"),
    cli("unknown_recipe", ["run.recipe=pretrian"],
        r"run\.recipe: unknown recipe 'pretrian' \(did you mean pretrain\?\)"),
    cli("unknown_preset", ["model.preset=huge"],
        r"model\.preset: unknown preset 'huge' \(presets: .*tiny"),
    cli("malformed_override", ["train.steps"],
        r"override 'train\.steps' is not of the form key\.sub=value"),
    cli("resume_missing", ["checkpoint.resume={tmp}/no_ckpt"],
        r"checkpoint\.resume: '.*no_ckpt' is not 'auto', 'never' or an existing checkpoint"),
    cli("tokenizer_missing", ["data.tokenizer={tmp}/tok.json"],
        r"data\.tokenizer: '.*tok\.json' is neither 'byte'"),
    cli("config_missing", [], r"cannot read", config="missing"),
    cli("config_not_yaml", [], r"not valid YAML", config="model: [1,\n"),
    cli("config_not_mapping", [], r"top level must be a mapping", config="- 1\n"),
    cli("config_no_model", [], r"model: required", config="train:\n  steps: 2\n"),
    # -- launch: data file, output dir, port, FlashAttention flags (before launching) ----------
    cli("missing_data_file", ["data.path={tmp}/no_such.jsonl"],
        r"data\.path: no file at '.*no_such\.jsonl'"),
    cli("data_path_is_dir", ["data.path={tmp}"],
        r"data\.path: no file at"),
    cli("output_dir_under_a_file", ["run.output_dir={tmp}/a_file/out"],
        r"run\.output_dir .*a_file/out is not a writable directory: Not a directory"),
    cli("output_dir_is_a_file", ["run.output_dir={tmp}/a_file"],
        r"run\.output_dir .*a_file is not a writable directory"),
    cli("output_dir_read_only_fs", ["run.output_dir=/proc/flashcp-out"],
        r"run\.output_dir /proc/flashcp-out is not a writable directory"),
    cli("port_in_use", [],
        r"FLASHCP_MASTER_PORT=\d+: binding 127\.0\.0\.1:\d+ is already in use",
        env={"FLASHCP_MASTER_PORT": PORT}),
    cli("port_not_a_number", [],
        r"FLASHCP_MASTER_PORT='http' is not a port number",
        env={"FLASHCP_MASTER_PORT": "http"}),
    cli("port_out_of_range", [],
        r"FLASHCP_MASTER_PORT='70000' is not a port number",
        env={"FLASHCP_MASTER_PORT": "70000"}),
    cli("fa_version_unknown", [],
        r"FlashAttention dispatch: FLAGS_flash_attn_version=7 is not a FlashAttention version",
        env={"FLAGS_flash_attn_version": "7"}),
    cli("fa_version_not_int", [],
        r"FLAGS_flash_attn_version='three' is not an integer",
        env={"FLAGS_flash_attn_version": "three"}),
    cli("fa4_unavailable", [],
        r"FLAGS_flash_attn_version=4 asks for FA4",
        env={"FLAGS_flash_attn_version": "4"}),
    # -- one rank of a launched job ------------------------------------------------------------
    worker("world_size_mismatch", {"PADDLE_TRAINERS_NUM": "4"},
           r"dp\(1\) × pp\(1\) × cp\(2\) = 2 but the job has 4 processes: set parallel\.cp to 4"),
    worker("world_size_indivisible", {"PADDLE_TRAINERS_NUM": "3"},
           r"the job has 3 processes: .*--nproc_per_node 2"),
    worker("worker_bad_override", W2, r"train\.lr: expected a number", ["train.lr=fast"]),
    worker("fault_unknown_kind", {**W2, "FLASHCP_FAULT": "explode@step1"},
           r"FLASHCP_FAULT: unknown fault kind 'explode'"),
    worker("fault_bad_syntax", {**W2, "FLASHCP_FAULT": "nan_loss:step3"},
           r"FLASHCP_FAULT: cannot parse 'nan_loss:step3'"),
    # -- masks (flashcp.masks.validate, CP attention's global mask) ----------------------------
    call("mask_int64", _validate(_idx(1, 1, 8, 1, dtype=np.int64), causal=True),
         ValueError, r"must be int32, got int64; cast it"),
    call("mask_float", _validate(_idx(1, 1, 8, 1, dtype=np.float32), causal=True),
         ValueError, r"must be int32, got float32"),
    call("mask_rank3", _validate(_idx(1, 8, 1), causal=True),
         ValueError, r"must be rank 4 \[B, Hm, Sk, C\]"),
    call("mask_rank5", _validate(_idx(1, 1, 8, 1, 1), causal=True),
         ValueError, r"must be rank 4"),
    call("mask_batch", _validate(_idx(1, 1, 8, 1), causal=True, batch=2),
         ValueError, r"query batch is 2"),
    call("mask_key_len", _validate(_idx(1, 1, 8, 1), causal=True, k_len=12),
         ValueError, r"key length is 12"),
    call("mask_heads", _validate(_idx(1, 3, 8, 1), causal=True, num_q_heads=8, num_kv_heads=2),
         ValueError, r"Hm=3 mask heads"),
    call("mask_causal_4_columns", _validate(_idx(1, 1, 8, 4), causal=True),
         ValueError, r"C=4 columns .*causal=True"),
    call("mask_noncausal_1_column", _validate(_idx(1, 1, 8, 1), causal=False),
         ValueError, r"C=1 columns .*to_noncausal"),
    call("mask_range_unordered_beyond_sq",  # 300 reads as Sq = 8 (upstream), still > LTE 5
         _validate(_idx(1, 1, 8, 2, fill=5, at=(0, 0, 3, 0), value=300), causal=True),
         ValueError, r"LTS > LTE \(300 > 5, first at \[b, h, j, c\] = \[0, 0, 3, 0\]"),
    call("mask_value_negative",
         _validate(_idx(1, 1, 8, 2, at=(0, 0, 1, 1), value=-1), causal=False),
         ValueError, r"value -1 is negative \(first at \[b, h, j, c\] = \[0, 0, 1, 1\]"),
    call("mask_range_unordered",
         _validate(_idx(1, 1, 8, 2, fill=5, at=(0, 0, 2, 0), value=7), causal=True),
         ValueError, r"LTS > LTE"),
    call("cp_mask_local_not_global", _cp(mask=masks.causal_mask(2, 4).indices),
         ValueError, r"covers 4 keys but the global sequence is 8"),
    call("cp_mask_missing", _cp(mask=None),
         ValueError, r"needs the global startend_row_indices"),
    # -- tensors (flashmask_attention, flashmask_attention_cp) ---------------------------------
    call("fp16_on_cpu", _attn(q_={"dtype": "float16"}, k_={"dtype": "float16"}),
         TypeError, r"float32"),
    call("gqa_heads", _attn(q_={"hq": 4}, k_={"hkv": 3}),
         ValueError, r"multiple of the KV heads"),
    call("head_dim_mismatch", _attn(k_={"d": 4}),
         ValueError, r"head_dim differ"),
    call("batch_mismatch", _attn(k_={"b": 1}),
         ValueError, r"batch sizes differ"),
    call("attention_mask_int64", _attn(mask=_idx(2, 1, 8, 1, fill=8, dtype=np.int64)),
         ValueError, r"int32"),
    call("attention_dropout", _attn(dropout=0.1),
         NotImplementedError, r"dropout"),
    call("cp_gqa_heads", _cp(q_={"hq": 4}, k_={"hkv": 3}),
         ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    call("cp_dropout", _cp(dropout=0.1),
         NotImplementedError, r"not supported under context parallelism"),
    # -- FlashAttention dispatch, fault specs --------------------------------------------------
    call("fa_version_5", _explain(5),
         ValueError, r"FLAGS_flash_attn_version=5 is not a FlashAttention version"),
    call("fa_policy_unknown", _explain(policy="maybe"),
         ValueError, r"fa4_unavailable='maybe' is not a policy"),
    call("fa_head_dim_zero", _explain(head_dim=0),
         ValueError, r"head_dim=0 must be a positive int"),
    call("fault_step_zero", lambda: faults.parse_faults("nan_loss@step0"),
         faults.FaultSpecError, r"steps count from 1"),
]
# fmt: on


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port with a listening socket on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def _fail(what: str) -> Callable[..., Any]:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError(f"{what} ran before the bad input was reported")

    return boom


def _written(out: Path) -> list[str]:
    """Files under `out`, except logs (the only thing a refused job may write)."""
    if not out.exists():
        return []
    files = [p for p in out.rglob("*") if p.is_file()]
    return [str(p.relative_to(out)) for p in files if p.relative_to(out).parts[0] != "logs"]


def _config_path(row: Row, tmp: Path) -> str:
    if row.config is None:
        return CONFIG
    if row.config == "missing":
        return str(tmp / "missing.yaml")
    path = tmp / "config.yaml"
    path.write_text(row.config)
    return str(path)


def test_table_is_big_and_covers_every_entry() -> None:
    assert len(ROWS) >= 40
    assert len({r.id for r in ROWS}) == len(ROWS)
    assert {r.entry for r in ROWS} == {"cli", "worker", "call"}


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_bad_input(
    row: Row,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    busy_port: int,
) -> None:
    # nothing may get as far as compute: launching, distributed init, the kernel, dispatch
    monkeypatch.setattr(job, "launch_command", _fail("launching the job"))
    monkeypatch.setattr(flashcp.distributed, "init_distributed", _fail("init_distributed"))
    monkeypatch.setattr(registry, "get_backend", _fail("the attention kernel"))
    monkeypatch.setattr(dispatch, "resolve_current", _fail("the FlashAttention dispatch"))
    for key in ("FLASHCP_MASTER_PORT", "FLAGS_flash_attn_version", "FLASHCP_FAULT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in row.env.items():
        monkeypatch.setenv(key, str(busy_port) if value == PORT else value)
    (tmp_path / "a_file").write_text("not a directory")

    if row.entry == "call":
        with pytest.raises(row.expect, match=row.match):  # type: ignore[arg-type]
            row.args()
        return

    out = tmp_path / "out"
    args = [a.replace("{tmp}", str(tmp_path)) for a in row.args]
    if not any(a.startswith("run.output_dir=") for a in args):
        args.append(f"run.output_dir={out}")
    config = _config_path(row, tmp_path)
    if row.entry == "cli":
        code = flashcp_cli.main(["train", config, *args])
    else:
        monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
        code = flashcp.train.main(["--config", config, *args])
    captured = capsys.readouterr()
    message = captured.err + captured.out
    assert code == row.expect, message
    assert re.search(row.match, message), f"{row.match!r} not in:\n{message}"
    assert _written(out) == []
    for arg in args:  # also for rows that point run.output_dir elsewhere
        if arg.startswith("run.output_dir="):
            target = Path(arg.split("=", 1)[1])
            if target.is_dir() and target != tmp_path:
                assert _written(target) == []
