"""`train.param_dtype: bfloat16` on CPU: bf16 storage, float32 compute (`flashcp.models.precision`).

The bf16-stored model computes exactly what the float32 model computes with its weights rounded
to bf16 (the layers upcast the stored weights; same float32 kernels); memory is measured with
Paddle's allocator (`flashcp.metrics.memory`): 2 bytes per parameter, no float32 copy of the
model at build time, none kept from forward to backward.
"""

from __future__ import annotations

import gc
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from flashcp.attention.context import AttentionContext
from flashcp.config import build_config
from flashcp.distributed import ParallelDims, build_groups
from flashcp.lora.model import apply_lora, lora_layers
from flashcp.metrics import memory
from flashcp.metrics.writer import read_metrics
from flashcp.models import build_model, preset
from flashcp.models import precision as precision_mod
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.rank_setup import forward_context
from flashcp.recipes.dpo import DPORecipe
from flashcp.trainer import Trainer
from helpers.batches import causal_batch

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True)
def _quiet_allocator() -> Any:
    """Allocator deltas count every tensor freed meanwhile: collect earlier tests' garbage first
    and keep the cycle collector from freeing it in the middle of a measurement."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _rounded_float32(name: str, **overrides: Any) -> paddle.nn.Layer:
    """The float32 model whose weights are the bf16 model's (rounded) values."""
    model = build_model(preset(name, **overrides), seed=0)
    with paddle.no_grad():
        for p in model.parameters():
            p.set_value(p.astype("bfloat16").astype("float32"))
    return model


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("tiny", {"position": "learned"}),
        ("tiny_glm", {"tie_embeddings": True}),
        ("tiny_glm_moe", {}),
    ],
)
def test_bf16_storage_equals_float32_on_rounded_weights(name: str, overrides: dict) -> None:
    ids, pos, ctx = causal_batch()
    b16 = build_model(preset(name, **overrides), param_dtype="bfloat16", seed=0)
    assert {p.dtype for p in b16.parameters()} == {paddle.bfloat16}
    ref = _rounded_float32(name, **overrides)
    got, want = b16(ids, pos, ctx), ref(ids, pos, ctx)
    assert got.dtype == paddle.float32
    # the same float32 kernels on the same values: bitwise
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    # negative control: the unrounded float32 model differs by ~ bf16 rounding (2^-9 relative)
    plain = build_model(preset(name, **overrides), seed=0)(ids, pos, ctx).numpy()
    assert np.abs(plain - want.numpy()).max() > 1e-4
    # trained bf16 weights get bf16 gradients (per micro-batch), close to the float32 ones
    got.mean().backward()
    want.mean().backward()
    for (n, p), (_, q) in zip(b16.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            continue
        assert p.grad is not None and p.grad.dtype == paddle.bfloat16, n
        g, h = p.grad.astype("float32").numpy(), q.grad.numpy()
        # bf16 rounding of each entry (<= 2^-9 relative); embedding rows and the tied matrix
        # also add a few bf16 contributions: norm-wise within 2^-7
        assert np.linalg.norm(g - h) <= 2.0**-7 * np.linalg.norm(h), n


def test_cast_linear_is_the_plain_kernel_when_dtypes_agree() -> None:
    rng = np.random.default_rng(0)
    x, w, b = (
        paddle.to_tensor(rng.standard_normal(s).astype("float32")) for s in [(3, 8), (8, 5), (5,)]
    )
    np.testing.assert_array_equal(
        precision_mod.cast_linear(x, w, b).numpy(), F.linear(x, w, b).numpy()
    )
    wt = paddle.to_tensor(w.numpy().T.copy())
    np.testing.assert_array_equal(
        precision_mod.cast_linear(x, wt, b, transpose=True).numpy(),
        (paddle.matmul(x, wt, transpose_y=True) + b).numpy(),
    )
    assert not precision_mod.needs_cast(x, w, None)
    assert precision_mod.needs_cast(x, w.astype("bfloat16"))


def test_lora_on_a_bf16_base_computes_the_float32_math() -> None:
    """Frozen bf16 base + float32 adapters (CastingLoRALinear): forward bitwise equal to the
    float32 model on rounded weights; adapter gradients equal up to float32 reordering."""
    ids, pos, ctx = causal_batch()
    targets = [".*_proj"]
    b16 = build_model(preset("tiny_glm"), param_dtype="bfloat16", seed=0)
    ref = _rounded_float32("tiny_glm")
    for model in (b16, ref):
        apply_lora(model, rank=4, alpha=8, target_modules=targets, seed=3)
        for name, layer in lora_layers(model):  # B away from zero, keyed by name
            rng = np.random.default_rng(len(name) * 7919 + sum(map(ord, name)))
            layer.lora_B.set_value(rng.normal(0, 0.05, layer.lora_B.shape).astype("float32"))
    assert {layer.lora_A.dtype for _, layer in lora_layers(b16)} == {paddle.float32}
    assert {layer.weight.dtype for _, layer in lora_layers(b16)} == {paddle.bfloat16}
    assert type(lora_layers(b16)[0][1]).__name__ == "CastingLoRALinear"
    got, want = b16(ids, pos, ctx), ref(ids, pos, ctx)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    got.mean().backward()
    want.mean().backward()
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters() if not p.stop_gradient}
    assert len(grads) == 2 * 6 * 2  # layers x (q, k, v, o, gate_up, down) x (A, B)
    for n, p in b16.named_parameters():
        if p.stop_gradient:
            assert p.grad is None, n
            continue
        # same products, possibly another summation order: a few ulps of the largest entry
        h = grads[n]
        np.testing.assert_allclose(p.grad.numpy(), h, rtol=0, atol=64 * EPS32 * np.abs(h).max())


def test_parameters_take_two_bytes_each() -> None:
    args = preset("tiny_glm", num_layers=8)
    before = memory.allocated_bytes()
    memory.reset_peak()
    model = build_model(args, param_dtype="bfloat16", seed=0)
    held = memory.allocated_bytes() - before
    peak = memory.peak_bytes() - before
    n = sum(int(np.prod(p.shape)) for p in model.parameters())
    largest = max(int(np.prod(p.shape)) for p in model.parameters())
    assert held == 2 * n  # exactly the bf16 parameters (no float32 copy left behind)
    # while building: at most one tensor's float32 block (4 B) and its bf16 cast (2 B) on top
    assert peak <= 2 * n + 6 * largest
    assert peak < 4 * n  # never a float32 model


def test_forward_backward_keeps_no_float32_copy_of_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weights dominate this model (short sequence): bf16 storage upcasts one weight at a
    time; a plain `F.linear(x, w.astype(...))` would keep every layer's float32 copy alive
    until backward (negative control)."""
    args = preset("tiny_glm", hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8)
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (1, 16)))
    pos = paddle.arange(16).unsqueeze(0)
    ctx = AttentionContext(mask=None, causal=True)

    def step_peak() -> tuple[int, int]:
        model = build_model(args, param_dtype="bfloat16", seed=0)
        apply_lora(model, rank=4, alpha=8, target_modules=[".*_proj"], seed=0)
        frozen = sum(int(np.prod(p.shape)) for p in model.parameters() if p.stop_gradient)
        before = memory.allocated_bytes()
        memory.reset_peak()
        model(ids, pos, ctx).mean().backward()
        return frozen, memory.peak_bytes() - before

    frozen, peak = step_peak()
    assert peak < 2 * frozen  # less than half of a float32 copy of the frozen weights

    def naive(x, w, b, transpose):  # type: ignore[no-untyped-def]
        return F.linear(x, w.astype(x.dtype), None if b is None else b.astype(x.dtype))

    monkeypatch.setattr(precision_mod._CastLinear, "apply", naive)
    _, naive_peak = step_peak()
    assert naive_peak > 3.5 * frozen


def test_dpo_reference_copy_is_frozen_bf16_of_the_stage() -> None:
    cfg = build_config(
        {
            "model": {"preset": "tiny_glm"},
            "train": {"param_dtype": "bfloat16"},
            "run": {"recipe": "dpo"},
        }
    )
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
    recipe = DPORecipe(cfg, groups)
    policy = build_model(cfg.model, param_dtype="bfloat16", seed=0)
    recipe.setup(policy)
    ref = recipe.reference
    assert ref is not None and ref is not policy
    assert all(p.dtype == paddle.bfloat16 and p.stop_gradient for p in ref.parameters())
    ids, pos, ctx = causal_batch()
    mb = MicroBatch(ids, pos, None, ctx)
    runner = PipelineRunner(policy, groups, forward_context=forward_context("float32"))
    (out,) = runner.forward_only([mb], lambda head, _: head.logits().numpy(), ref)
    rounded = _rounded_float32("tiny_glm")
    np.testing.assert_array_equal(out, rounded.logits(rounded(ids, pos, ctx)).numpy())


def _dpo(tmp: Path, **train: Any) -> Any:
    return build_config(
        {
            "model": {"preset": "tiny_glm"},
            "data": {"seq_len": 128},
            "train": {"steps": 3, "lr": 3e-3, "warmup_steps": 0, "grad_accum": 2, **train},
            "checkpoint": {"every": 0},
            "run": {"recipe": "dpo", "output_dir": str(tmp)},
            "lora": {"rank": 4, "alpha": 8.0, "target_modules": [".*_proj"]},
        }
    )


def test_lora_dpo_trains_on_a_bf16_base_like_float32_on_its_rounded_weights(
    tmp_path: Path,
) -> None:
    b16 = _dpo(tmp_path / "b16", param_dtype="bfloat16")
    trainer = Trainer(b16, stream=io.StringIO())
    trainer.fit()
    assert {p.dtype for _, p in trainer.params} == {paddle.float32}  # adapters
    base = [p for p in trainer.model.parameters() if p.stop_gradient]
    assert {p.dtype for p in base} == {paddle.bfloat16}
    info = json.loads((tmp_path / "b16" / "run_info.json").read_text())
    (rank,) = info["ranks"]
    n_base = sum(int(np.prod(p.shape)) for p in base)
    n_lora = rank["trainable_params_local"]
    assert info["param_dtype"] == "bfloat16"
    assert rank["param_bytes_local"] == 2 * n_base + 4 * n_lora
    assert rank["params_local"] == n_base + n_lora
    # the same run in float32 from the bf16 weights (saved as float32): same math
    weights = build_model(b16.model, param_dtype="bfloat16", seed=0)
    save_hf_checkpoint(weights, tmp_path / "w", dtype="float32")
    f32 = _dpo(tmp_path / "f32")
    f32.checkpoint.init_from = str(tmp_path / "w")
    Trainer(f32, stream=io.StringIO()).fit()
    got = [r["loss"] for r in read_metrics(tmp_path / "b16")]
    want = [r["loss"] for r in read_metrics(tmp_path / "f32")]
    assert got[0] == want[0] == pytest.approx(math.log(2))
    # adapter updates agree up to float32 reordering, then propagate: ~1e-6 of the loss
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_training_bf16_weights_steps_float32_masters(tmp_path: Path) -> None:
    """Trained weights stored in bf16 (no lora section: the whole policy trains) get float32
    master weights from the optimizer (`flashcp.optim.master_optimizer.MasterOptimizer`); the
    parameters stay bf16 and move after a step."""
    from flashcp.optim.master_optimizer import MasterOptimizer

    cfg = _dpo(tmp_path, param_dtype="bfloat16")
    cfg.extras.pop("lora")
    trainer = Trainer(cfg, stream=io.StringIO())
    assert isinstance(trainer.optimizer, MasterOptimizer)
    assert trainer.optimizer.low_precision == "bfloat16"
    assert {str(p.dtype) for _, p in trainer.params} == {"paddle.bfloat16"}
    before = {n: p.astype("float32").numpy() for n, p in trainer.params}
    m = trainer.train_step()
    assert np.isfinite(m.loss) and np.isfinite(m.grad_norm)
    after = {n: p.astype("float32").numpy() for n, p in trainer.params}
    moved = [n for n in after if not np.array_equal(after[n], before[n])]
    assert moved and {str(p.dtype) for _, p in trainer.params} == {"paddle.bfloat16"}
