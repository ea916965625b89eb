"""GLM-4.5's multi-token-prediction (MTP) layer in HF checkpoints: a GLM-4.5-shaped directory
written by hand under the HF names (``model.layers.{L}.embed_tokens / enorm / hnorm / eh_proj /
shared_head.*`` and a MoE block, `[out, in]` weights, experts one key each) loads into
`model.mtp_layers` 1 tensor for tensor — whole, per pipeline stage (the last holds it) and per
ep rank (its experts only) — and the stage-by-stage, ep-rank-by-ep-rank merged export writes the
same bytes back; a missing MTP tensor is refused by name; `model.mtp_layers: 0` skips them."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors import safe_open

from flashcp.checkpoint.merge_export import write_merged_index, write_merged_stage
from flashcp.models import ModelArgs, build_model
from flashcp.models.hf_check import CheckpointMismatchError
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.pipeline.stage import stage_spec
from helpers.hf_glm45 import layer_shapes, random_checkpoint, write_checkpoint

ARGS = ModelArgs(
    arch="glm_moe", vocab_size=48, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=8, intermediate_size=40, max_seq_len=64, qkv_bias=True, use_qk_norm=True,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
    first_k_dense_replace=1, mtp_layers=1,
).check()  # fmt: skip
L = ARGS.num_layers  # the MTP layer's index
MTP = f"model.layers.{L}."
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj", "down_proj",
          "eh_proj", "head", "lm_head")  # fmt: skip
"""Modules whose ``.weight`` HF stores `[out, in]` and flashcp (Paddle) `[in, out]`."""


def flashcp_value(module: paddle.nn.Layer, key: str, first_expert: int = 0) -> np.ndarray:
    """What flashcp holds for HF `key`, in HF's layout: `[in, out]` weights transposed back,
    an expert's ``gate_proj`` / ``up_proj`` the column halves of its ``gate_up_proj`` row."""
    state = module.state_dict()
    e = re.match(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", key)
    if e is not None:
        row = int(e.group(2)) - first_expert
        if e.group(3) == "down":
            return state[f"{e.group(1)}.down_proj"].numpy()[row].T
        both = state[f"{e.group(1)}.gate_up_proj"].numpy()[row]
        half = both.shape[1] // 2
        return (both[:, :half] if e.group(3) == "gate" else both[:, half:]).T
    value = state[key].numpy()
    owner = key.rsplit(".", 2)[-2]
    return value.T if key.endswith(".weight") and owner in LINEAR else value


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    weights = random_checkpoint(ARGS)
    return write_checkpoint(tmp_path_factory.mktemp("glm45"), weights), weights


def test_the_mtp_layer_loads_under_its_hf_names(checkpoint) -> None:
    path, weights = checkpoint
    model = build_model(ARGS, seed=1)
    report = load_hf_checkpoint(model, path)
    assert sorted(report.loaded) == sorted(weights) and report.skipped == []
    mtp_keys = [k for k in weights if k.startswith(MTP)]
    assert len(mtp_keys) == 6 + 11 + 2 + 3 * (ARGS.num_experts + 1)  # parts, attn, router, mlps
    assert set(mtp_keys) <= set(report.loaded)
    for key in weights:
        np.testing.assert_array_equal(flashcp_value(model, key), weights[key], err_msg=key)
    (layer,) = model.mtp_layers()
    assert layer is model.model.layers[L] and list(layer.eh_proj.weight.shape) == [64, 32]
    assert not layer.eh_proj.weight.stop_gradient  # loaded trainable; λ = 0 freezes it later


@pytest.mark.parametrize("pp", [2, 3])
def test_the_last_stage_reads_the_mtp_layer_and_no_other_does(checkpoint, pp: int) -> None:
    path, weights = checkpoint
    held: set[str] = set()
    for s in range(pp):
        spec = stage_spec(ARGS, s, pp)
        stage = build_model(ARGS, stage=spec, seed=2)
        report = load_hf_checkpoint(stage, path)
        mtp_read = {k for k in report.loaded if k.startswith(MTP)}
        if spec.is_last:
            assert mtp_read == {k for k in weights if k.startswith(MTP)}
            assert len(stage.mtp_layers()) == 1
        else:  # left to the last stage: neither read nor refused
            assert not mtp_read and not stage.mtp_layers()
            assert {k for k in report.foreign if k.startswith(MTP)} == {
                k for k in weights if k.startswith(MTP)
            }
        for key in report.loaded:
            np.testing.assert_array_equal(flashcp_value(stage, key), weights[key], err_msg=key)
        held |= set(report.loaded)
    assert held == set(weights)  # the stages together read the whole checkpoint once


@pytest.mark.parametrize("pp", [1, 2])
def test_pp_and_ep_ranks_import_and_export_the_mtp_layer_bitwise(
    checkpoint, tmp_path: Path, pp: int
) -> None:
    """Each (stage, ep rank) of pp × ep 2 loads its share (the MTP experts split like any
    layer's) and writes it with the merged export's stage writer, as `Trainer.export_merged`
    does rank by rank; the directory holds the checkpoint's bytes under the same keys."""
    path, weights = checkpoint
    out = tmp_path / "export"
    for s in range(pp):
        for r in range(2):
            spec = dataclasses.replace(stage_spec(ARGS, s, pp), ep_rank=r, ep_size=2)
            stage = build_model(ARGS, stage=spec, seed=3)
            report = load_hf_checkpoint(stage, path)
            mtp_experts = {k for k in report.loaded if k.startswith(MTP + "mlp.experts.")}
            if spec.is_last:  # experts 2r, 2r + 1 of the MTP layer, and no other
                assert {int(k.split(".")[5]) for k in mtp_experts} == {2 * r, 2 * r + 1}
            for key in report.loaded:
                got = flashcp_value(stage, key, first_expert=2 * r)
                np.testing.assert_array_equal(got, weights[key], err_msg=key)
            write_merged_stage(stage, out, ep_rank=r, ep=2)
    write_merged_index(out, ARGS, pp * 2, "float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(weights)
    for key, name in index.items():
        with safe_open(str(out / name), "numpy") as f:
            np.testing.assert_array_equal(f.get_tensor(key), weights[key], err_msg=key)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    "drop",
    [
        [MTP + "hnorm.weight"],
        [MTP + "shared_head.head.weight", MTP + "mlp.experts.3.down_proj.weight"],
    ],
    ids=["part", "head-and-expert"],
)
def test_a_missing_mtp_tensor_is_refused_by_name(checkpoint, tmp_path: Path, drop) -> None:
    _, weights = checkpoint
    path = write_checkpoint(tmp_path / "ckpt", {k: v for k, v in weights.items() if k not in drop})
    model = build_model(ARGS, seed=4)
    before = {n: t.numpy().copy() for n, t in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(model, path)
    text = str(info.value)
    assert f"multi-token-prediction (MTP) weights missing from the checkpoint ({len(drop)})" in text
    assert all(key in text for key in drop) and "set model.mtp_layers" in text
    assert "\n  missing from the checkpoint" not in text  # nothing else is
    for name, t in model.state_dict().items():  # refused before any tensor was read
        np.testing.assert_array_equal(t.numpy(), before[name], err_msg=name)
    # the stage that needs it names it; the others load (their tensors are all there)
    last = build_model(ARGS, stage=stage_spec(ARGS, 1, 2), seed=4)
    with pytest.raises(CheckpointMismatchError, match=re.escape(drop[0])):
        load_hf_checkpoint(last, path)
    load_hf_checkpoint(build_model(ARGS, stage=stage_spec(ARGS, 0, 2), seed=4), path)


def test_a_checkpoint_without_mtp_layers_is_refused_for_a_model_with_them(
    checkpoint, tmp_path: Path
) -> None:
    _, weights = checkpoint
    main = {k: v for k, v in weights.items() if not k.startswith(MTP)}
    path = write_checkpoint(tmp_path / "ckpt", main)
    count = sum(k.startswith(MTP) for k in weights)
    missing = rf"MTP\) weights missing from the checkpoint \({count}\)"
    with pytest.raises(CheckpointMismatchError, match=missing) as info:
        load_hf_checkpoint(build_model(ARGS, seed=4), path)
    first = str(info.value).splitlines()[0]  # what a one-line failure summary keeps
    assert first == (
        f"checkpoint {path} does not fit the glm_moe model: {count} multi-token-prediction "
        "tensors missing (set model.mtp_layers=0 to train without the layers it lacks) "
        "(listed below)"
    )
    plain = dataclasses.replace(ARGS, mtp_layers=0)  # the model without them loads it
    assert load_hf_checkpoint(build_model(plain, seed=4), path).skipped == []


def test_mtp_layers_zero_skips_them_with_a_note(
    checkpoint, caplog: pytest.LogCaptureFixture
) -> None:
    path, weights = checkpoint
    plain = dataclasses.replace(ARGS, mtp_layers=0)
    model = build_model(plain, seed=5)
    with caplog.at_level(logging.INFO, logger="flashcp"):
        report = load_hf_checkpoint(model, path)
    assert report.skipped_mtp == [L]
    assert sorted(report.skipped) == sorted(k for k in weights if k.startswith(MTP))
    assert sorted(report.loaded) == sorted(k for k in weights if not k.startswith(MTP))
    notes = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(notes) == 1 and f"model.layers.{L}: model.mtp_layers is 0" in notes[0]
    assert "\n" not in notes[0]
    for key in report.loaded:
        np.testing.assert_array_equal(flashcp_value(model, key), weights[key], err_msg=key)


def test_a_deeper_layer_without_mtp_parts_is_not_skipped(checkpoint, tmp_path: Path) -> None:
    """Only layers that ARE MTP layers (an ``eh_proj``) are skipped: a checkpoint with one
    more plain decoder layer than the model is still refused as unexpected."""
    _, weights = checkpoint
    deeper = {k: v for k, v in weights.items() if not k.startswith(MTP)}
    deeper.update({k: v for k, v in random_checkpoint(ARGS).items() if k in layer_shapes(ARGS, L)})
    plain = dataclasses.replace(ARGS, mtp_layers=0)
    count = len(layer_shapes(ARGS, L))
    with pytest.raises(CheckpointMismatchError, match=rf"unexpected in the checkpoint \({count}\)"):
        load_hf_checkpoint(build_model(plain, seed=6), write_checkpoint(tmp_path / "c", deeper))
