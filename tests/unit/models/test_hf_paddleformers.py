"""A GLM-4.5 directory as PaddleFormers 1.2.0 writes it — made by PaddleFormers itself: its
eager ``Glm4MoeForCausalLMDeprecated`` with random weights, ``save_pretrained`` — loads in
flashcp as it is (its class name and its own config.json keys accepted, with a note), computes
what PaddleFormers' own ``from_pretrained`` of the same directory computes, trains, and its
export loads back into PaddleFormers' class with the trained model's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml
from safetensors import safe_open

from bench import numerics
from flashcp import cli, masks
from flashcp.attention.context import AttentionContext
from flashcp.checkpoint.export import ExportError, export_run
from flashcp.config import build_config, collect
from flashcp.models import preset
from flashcp.models.families.glm4 import PADDLEFORMERS_IGNORED
from flashcp.models.hf_config import IGNORED_KEYS, parse_hf_config
from flashcp.parallelize import default_model_factory
from helpers.configs import tiny_config
from helpers.paddleformers_glm import glm_logits, load_glm, random_glm, save_glm
from helpers.trainruns import fit

ARGS = preset(
    "tiny_glm_moe", vocab_size=300, use_qk_norm=True, rotary_base=50_000.0, max_seq_len=64
)
IDS = np.random.default_rng(0).integers(0, 300, (2, 16))
PADDLEFORMERS_KEYS = {
    "disable_ffn_model_parallel", "fd_fallback", "fuse_rms_norm", "paddleformers_version",
    "pp_seg_method", "scoring_func", "seq_aux", "sliding_window", "topk_method", "use_fp8",
    "using_flex_token",
}  # fmt: skip
"""The keys of PaddleFormers' config.json that transformers' Glm4MoeConfig does not have (the
11 of issue 32)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the directory PaddleFormers saved, its in-memory model, PaddleFormers' load of it)."""
    directory = tmp_path_factory.mktemp("pf") / "glm45"
    model = random_glm(ARGS, seed=3)
    save_glm(model, directory)
    return directory, model, load_glm(directory)


def _logits(model: paddle.nn.Layer, ids: np.ndarray) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=masks.causal_mask(b, s).indices, causal=True)
    with paddle.no_grad():
        return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


def _raw(directory: Path) -> dict[str, Any]:
    return {"model": {"from_pretrained": str(directory)},
            "data": {"seq_len": 32, "tokenizer": "byte"}, "run": {"device": "cpu"}}  # fmt: skip


def _compare(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """flashcp vs PaddleFormers logits: another implementation, so another summation order —
    the float32 rule, n the longest reduction in front of a logit (hidden size × tokens)."""
    numerics.assert_close(got, want, n=ARGS.hidden_size * IDS.shape[1], what=what)


def test_config_json_is_accepted_with_a_note(
    saved: tuple[Path, Any, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = saved[0]
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLMDeprecated"]
    assert set(config) >= PADDLEFORMERS_KEYS  # what PaddleFormers writes (issue 32)
    values, notes = parse_hf_config(config)
    for key in ("num_layers", "num_experts", "use_qk_norm", "rotary_base", "qkv_bias"):
        assert values[key] == getattr(ARGS, key), key
    ignored = sorted(PADDLEFORMERS_KEYS & (set(IGNORED_KEYS) | set(PADDLEFORMERS_IGNORED)))
    assert notes == [
        f"config.json keys {', '.join(ignored)} steer only PaddleFormers' own training or "
        "inference (parallelism, kernels, outputs, auxiliary losses), not the model: ignored"
    ]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_raw(directory)))
    assert cli.main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"      note: {directory}: {notes[0]}\n" in out
    # a key that changes the maths, at a value flashcp does not compute: one line, the reason
    bad = tmp_path / "fp8"
    shutil.copytree(directory, bad)
    (bad / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    _, errors = collect(_raw(bad))
    assert [str(e) for e in errors] == [
        f"model.from_pretrained: {bad}/config.json: scoring_func: 'softmax' is not implemented "
        "(flashcp's GLM-4.5 router scores experts with a sigmoid (as GLM-4.5 and transformers' "
        "Glm4MoeForCausalLM do)): use a checkpoint with 'sigmoid'"
    ]


def test_router_weight_stored_in_bfloat16_is_read_exactly(saved: tuple[Path, Any, Any]) -> None:
    """PaddleFormers saves ``mlp.gate.weight`` in bfloat16 from a float32 model (its inverse
    conversion casts it); flashcp widens it exactly, to what PaddleFormers itself loads."""
    directory, _, pf = saved
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.mlp.gate.weight"
    with safe_open(str(directory / index[key]), "numpy") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes[key] == "BF16"
    assert {d for k, d in dtypes.items() if k != key} == {"F32"}
    model = default_model_factory(build_config(_raw(directory)))
    ours = model.model.layers[1].mlp.gate.weight
    theirs = pf.model.layers[1].mlp.gate.weight
    assert str(ours.dtype) == str(theirs.dtype) == "paddle.float32"
    np.testing.assert_array_equal(ours.numpy().T, theirs.numpy())  # flashcp stores [in, out]
    raw = ours.numpy().view(np.uint32)
    assert not (raw & 0xFFFF).any()  # bfloat16 values, widened: low 16 bits zero


def test_logits_equal_paddleformers_own_load(saved: tuple[Path, Any, Any]) -> None:
    directory, in_memory, pf = saved
    got = _logits(default_model_factory(build_config(_raw(directory))), IDS)
    _compare(got, glm_logits(pf, IDS), "flashcp vs PaddleFormers' from_pretrained")
    # negative control: the model before its router weights went through bfloat16 routes
    # some tokens to other experts; a load that kept float32 routers would match this one
    numerics.assert_rejects(got, glm_logits(in_memory, IDS), n=ARGS.hidden_size * IDS.shape[1])


def test_trains_and_exports_back_into_paddleformers(
    saved: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    """A run from the directory (SFT-free LM steps on the built-in corpus) exports a directory
    PaddleFormers' class loads, with the trained model's logits."""
    directory, _, pf = saved
    cfg = tiny_config(tmp_path, base={"model": {"from_pretrained": str(directory)}},
                      data={"seq_len": 32, "micro_batch_size": 2, "tokenizer": "byte"},
                      train={"steps": 2, "lr": 1e-2, "warmup_steps": 0, "seed": 1},
                      checkpoint={"every": 2}, run={"device": "cpu"})  # fmt: skip
    fitted = fit(cfg)
    assert [r["step"] for r in fitted.records] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in fitted.records)
    out = tmp_path / "export"
    with pytest.raises(ExportError, match="--adapters-for: .* has no lora section"):
        export_run(tmp_path / "run", out, adapters_for="paddleformers")
    export_run(tmp_path / "run", out)
    trained = _logits(fitted.trainer.model, IDS)
    back = load_glm(out)
    _compare(glm_logits(back, IDS), trained, "PaddleFormers' load of the export vs the run")
    numerics.assert_rejects(glm_logits(pf, IDS), trained, n=ARGS.hidden_size * IDS.shape[1])
