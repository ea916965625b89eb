"""The job's preflight (`flashcp.launch.preflight`): the master port, the launch command that
carries it, the output directory check; the checks `flashcp validate`, `flashcp train` and a
launched rank share (device, dispatch, data sample, model directory)."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path

import pytest

from flashcp import fa_dispatch
from flashcp import preflight as config_preflight
from flashcp.launch import job, preflight
from helpers.paths import ROOT


def test_master_port() -> None:
    assert preflight.master_port({}) is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.listen(1)
        with pytest.raises(preflight.PreflightError, match="is already in use"):
            preflight.master_port({preflight.ENV_MASTER_PORT: str(port)})
    assert preflight.master_port({preflight.ENV_MASTER_PORT: f" {port} "}) == port  # free again
    with pytest.raises(preflight.PreflightError, match="not a port number"):
        preflight.master_port({preflight.ENV_MASTER_PORT: "0"})


def test_launch_command_with_master_port(tmp_path: Path) -> None:
    cmd = job.launch_command("c.yaml", ["a=1"], 2, tmp_path, 29500)
    assert cmd[cmd.index("--master") + 1] == "127.0.0.1:29500"
    assert "--master" not in job.launch_command("c.yaml", [], 2, tmp_path)


def test_check_output_dir(tmp_path: Path) -> None:
    logs = preflight.check_output_dir(tmp_path / "a" / "b")
    assert logs == tmp_path / "a" / "b" / "logs" and logs.is_dir()
    assert list(logs.iterdir()) == []  # the write probe is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(preflight.PreflightError, match="not a writable directory: Not a directory"):
        preflight.check_output_dir(tmp_path / "f")


# -- one preflight for validate, train and every rank (issue 27, defect 3) -------------------


def _model_dir_without_mtp_tensors(directory: Path) -> Path:
    """A GLM-4.5 directory as transformers' save_pretrained writes one: config.json declares
    num_nextn_predict_layers 1, the weights hold no MTP layer."""
    from flashcp.models import build_model, preset
    from flashcp.models.hf_config import hf_config
    from flashcp.models.hf_save import save_hf_checkpoint

    args = preset("tiny_glm_moe", vocab_size=300, max_seq_len=64)
    save_hf_checkpoint(build_model(args, seed=3), directory)
    declared = {**hf_config(args), "num_nextn_predict_layers": 1}
    (directory / "config.json").write_text(json.dumps(declared))
    return directory


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Files the refused runs point at."""
    tmp = tmp_path_factory.mktemp("inputs")
    (tmp / "no_text.jsonl").write_text('{"txt": "a"}\n{"txt": "b"}\n')
    (tmp / "empty_text.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (tmp / "qa.jsonl").write_text('{"question": "2+2?", "answer": "4"}\n')
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    (tmp / "docs.jsonl").write_text('{"text": "a document"}\n')
    mtp = _model_dir_without_mtp_tensors(tmp / "glm45_saved")
    return {"tmp": str(tmp), "mtp_dir": str(mtp)}


GPT = "configs/gpt/tiny_cp2.yaml"
SFT = "configs/gpt/tiny_sft_packed_cp2.yaml"
MOE = "configs/glm/tiny_moe_cp2.yaml"
# (id, config, overrides, environment, the one line's key and words (its fix), the overrides
# (or `env:` settings) that make the same run valid: the negative control)
REFUSED = [
    ("bf16_on_this_cpu", GPT, ["train.dtype=bfloat16"], {},
     "train.dtype: bfloat16 needs a GPU and this run is on CPU: set train.dtype=auto, or set "
     "train.dtype=float32", ["train.dtype=auto"]),
    ("gpu_on_this_cpu", GPT, ["run.device=gpu"], {},
     "run.device: gpu, but Paddle sees no GPU here (CPU build or no device): set "
     "run.device=auto, or set run.device=cpu", ["run.device=auto"]),
    ("fa4_flag", GPT, [], {"FLAGS_flash_attn_version": "4"},
     "FlashAttention dispatch: FLAGS_flash_attn_version=4 asks for FA4",
     ["env:FLASHCP_FA4_UNAVAILABLE=fallback"]),
    ("no_usable_records", GPT, ["data.path={tmp}/empty_text.jsonl"], {},
     "data.path: {tmp}/empty_text.jsonl: no usable records (2 rows; 2 bad records skipped: "
     "empty text", ["data.path={tmp}/docs.jsonl"]),
    ("no_format", GPT, ["data.path={tmp}/no_text.jsonl"], {},
     "data.path: {tmp}/no_text.jsonl: none of the 2 rows sampled is in a format run.recipe "
     "pretrain reads (`text`: a string): the rows' fields are txt (string); to read them set "
     "data.text_field=txt", ["data.text_field=txt"]),
    ("sft_fields", SFT, ["data.path={tmp}/qa.jsonl"], {},
     "data.path: {tmp}/qa.jsonl: none of the 1 rows sampled is in a format run.recipe sft "
     "reads (`messages`: [{role, content}]; ShareGPT `conversations`: [{from, value}] "
     "(human/gpt/system); PaddleFormers `src`, `tgt` (+ `system`); Alpaca `instruction`, "
     "`input`, `output`; `prompt`, `response` strings (no chat template)): the rows' fields "
     "are question (string), answer (string); to read them set data.prompt_field=question "
     "data.response_field=answer",
     ["data.prompt_field=question", "data.response_field=answer"]),
    ("no_chat_template", SFT, ["data.path={tmp}/chat.jsonl"], {},
     "data.path: {tmp}/chat.jsonl:1: the byte tokenizer has no chat template", ["data.path=null"]),
    ("eval_no_usable_records", GPT, ["eval.path={tmp}/empty_text.jsonl"], {},
     "eval.path: {tmp}/empty_text.jsonl: no usable records", ["eval.path={tmp}/docs.jsonl"]),
    ("mtp_without_tensors", MOE,
     ["model.from_pretrained={mtp_dir}", "data.tokenizer=byte", "data.seq_len=64"], {},
     "model.mtp_layers: {mtp_dir}/config.json declares num_nextn_predict_layers: 1, but the "
     "weights in {mtp_dir} hold no tensor of the multi-token-prediction layer model.layers.2.* "
     "(transformers' save_pretrained leaves them out): set model.mtp_layers=0",
     ["model.mtp_layers=0"]),
]  # fmt: skip


def _fill(text: str, inputs: dict[str, str]) -> str:
    return text.replace("{tmp}", inputs["tmp"]).replace("{mtp_dir}", inputs["mtp_dir"])


@pytest.mark.parametrize(("config", "overrides", "env", "line", "valid"),
                         [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])  # fmt: skip
def test_validate_train_and_a_rank_refuse_before_compute(
    config: str,
    overrides: list[str],
    env: dict[str, str],
    line: str,
    valid: list[str],
    inputs: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What `flashcp train` (and a rank started by paddle.distributed.launch) would fail after
    launch, `flashcp validate` refuses too: the same one line naming the key and the fix, exit
    2, nothing launched, no rank started, nothing written. The negative control: with the fix,
    validate passes."""
    from flashcp import cli, distributed
    from flashcp.launch import worker

    for key in (fa_dispatch.FLAG_VERSION, fa_dispatch.ENV_FA4_POLICY):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("reached the launch")

    monkeypatch.setattr(job, "launch_command", never)
    monkeypatch.setattr(distributed, "init_distributed", never)
    path = str(ROOT / config)
    out = tmp_path / "run"
    args = [_fill(a, inputs) for a in overrides] + [f"run.output_dir={out}"]
    want = _fill(line, inputs)
    assert cli.main(["validate", path, *args]) == preflight.EXIT_PREFLIGHT
    printed = capsys.readouterr().out
    assert f"FAIL  config problem in {path}: {want}" in printed, printed
    assert cli.main(["train", path, *args]) == preflight.EXIT_PREFLIGHT
    err = capsys.readouterr().err
    assert err.startswith(f"config problem in {path}: {want}") and err.count("\n") == 1, err
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    assert worker.main(["--config", path, *args]) == preflight.EXIT_PREFLIGHT
    assert want in capsys.readouterr().err
    assert not out.exists()
    fixed = [_fill(a, inputs) for a in valid if not a.startswith("env:")]
    for setting in (a.removeprefix("env:") for a in valid if a.startswith("env:")):
        monkeypatch.setenv(*setting.split("=", 1))
    assert cli.main(["validate", path, *args, *fixed]) == 0, capsys.readouterr().out


def test_model_directory_index_names_what_is_missing(tmp_path: Path) -> None:
    """The tensor index alone (no tensor read) against the layers the model builds: a missing
    decoder layer, an MTP layer declared without tensors (its fix: the layers held), a shard the
    index names but the directory lacks."""
    from flashcp.config import build_config
    from flashcp.models import build_model, preset
    from flashcp.models.hf_check import index_problems
    from flashcp.models.hf_save import save_hf_checkpoint

    args = preset("tiny_glm_moe", vocab_size=300, max_seq_len=64, num_layers=3)
    directory = tmp_path / "sharded"
    save_hf_checkpoint(build_model(args, seed=1), directory, max_shard_bytes=60_000)
    assert index_problems(directory, args) == []
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if not k.startswith(("model.layers.0.", "model.layers.2."))}  # fmt: skip
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    deeper = dataclasses.replace(args, mtp_layers=2)
    (layers, mtp) = index_problems(directory, deeper)
    assert layers.key == "checkpoint.init_from"
    assert "no tensors of decoder layers 0, 2" in layers.message
    assert mtp.key == "model.mtp_layers" and "MTP layer 3-4 is absent" in mtp.message
    assert "no tensor of model.layers.3.*" in mtp.message
    assert mtp.fixes == ((("model.mtp_layers", 0),),)
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    shard.unlink()
    raw = {"model": {"preset": "tiny_glm_moe", "vocab_size": 300, "max_seq_len": 64,
                     "num_layers": 3},
           "checkpoint": {"init_from": str(directory)}, "data": {"seq_len": 64}}  # fmt: skip
    (problem,) = config_preflight.model_dir_problems(build_config(raw))
    assert problem.key == "checkpoint.init_from" and f"to {shard.name}, which does not exist" in (
        problem.message
    )


def test_one_tokenizer_problem_is_reported_once_and_a_config_built_in_code_is_checked(
    tmp_path: Path, inputs: dict[str, str]
) -> None:
    """data.path and eval.path read through one tokenizer: its problem is one line, not two; a
    `Config` built in code (no file) gets the same preflight from its resolved mapping."""
    from flashcp.config import build_config

    chat = f"{inputs['tmp']}/chat.jsonl"
    raw = {"model": {"preset": "tiny", "max_seq_len": 64}, "data": {"seq_len": 64, "path": chat},
           "eval": {"path": chat},
           "run": {"recipe": "sft", "output_dir": str(tmp_path)}}  # fmt: skip
    cfg = build_config(raw)
    (problem,) = config_preflight.preflight_problems(cfg)
    assert problem.key == "data.path" and "has no chat template" in problem.message
    raw["data"]["path"] = raw["eval"]["path"] = f"{inputs['tmp']}/docs.jsonl"
    raw["run"]["recipe"] = "pretrain"
    assert config_preflight.preflight_problems(build_config(raw)) == []


@pytest.mark.parametrize(
    ("config_policy", "env_policy", "refused"),
    [
        ("fallback", None, False),
        ("fallback", "error", False),  # the config's policy beats the environment's
        ("error", "fallback", True),
        (None, "fallback", False),
        (None, None, True),
    ],
)
def test_preflight_honours_the_configs_fa4_policy(
    config_policy: str | None,
    env_policy: str | None,
    refused: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FA4 asked for (FLAGS_flash_attn_version=4) and absent on this CPU: the preflight
    resolves the policy as every rank does, `attention.fa4_unavailable` first, then
    FLASHCP_FA4_UNAVAILABLE, then error; only an `error` policy refuses."""
    from flashcp.config import load_config

    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")
    monkeypatch.delenv(fa_dispatch.ENV_FA4_POLICY, raising=False)
    if env_policy is not None:
        monkeypatch.setenv(fa_dispatch.ENV_FA4_POLICY, env_policy)
    over = [] if config_policy is None else [f"attention.fa4_unavailable={config_policy}"]
    cfg = load_config(ROOT / GPT, over)
    assert cfg.attention.fa4_unavailable == config_policy
    problems = config_preflight.dispatch_problems(cfg)
    if refused:
        (problem,) = problems
        assert problem.key == config_preflight.DISPATCH_KEY
        assert "FLAGS_flash_attn_version=4 asks for FA4" in problem.message
    else:
        assert problems == [], problems
