"""The per-layer terms of the memory plan (`flashcp.plan.layer`) against Paddle's allocator."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.models import build_model, preset
from flashcp.optim.trainable import attach_main_grad, holder
from flashcp.plan.counts import Dtypes
from flashcp.plan.layer import upcast_transient, weight_copies


def _largest_linear(model: Any, index: int) -> tuple[Any, paddle.Tensor]:
    """The sublayer of decoder layer `index` owning its largest 2-D weight, and that weight."""
    prefix = f"model.layers.{index}."
    name, weight = max(
        ((n, p) for n, p in model.named_parameters() if n.startswith(prefix) and p.ndim == 2),
        key=lambda item: int(np.prod(item[1].shape)),
    )
    sublayers = dict(model.named_sublayers())
    return sublayers[name.rsplit(".", 1)[0]], weight


def _backward_peak(module: Any, weight: paddle.Tensor, frozen: bool) -> int:
    """The allocator's peak above the start of `module`'s backward on 2 tokens, on the second
    of two steps (a trained weight's float32 main_grad exists then: steady state)."""
    weight.stop_gradient = frozen
    _hooks = None if frozen else attach_main_grad(holder([weight]), "bfloat16")
    x = paddle.randn([2, int(weight.shape[0])])
    x.stop_gradient = False
    core = paddle.base.core
    peak = 0
    for _ in range(2):
        out = module(x)
        grad = paddle.randn(out.shape)
        gc.collect()
        start = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        out.backward(grad)
        peak = core.host_memory_stat_peak_value("Allocated", 0) - start
        del out, grad
        x.clear_gradient()
    if not frozen:
        assert weight.main_grad.dtype == paddle.float32 and weight.grad is None
    return int(peak)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
@pytest.mark.parametrize(
    ("preset_name", "index"), [("tiny_llama", 0), ("tiny_glm", 1), ("tiny_qwen3_moe", 0)]
)
def test_upcast_transient_is_the_largest_weights_backward(
    preset_name: str, index: int, frozen: bool
) -> None:
    """bf16 storage, float32 compute (CPU): the backward of layer `index`'s largest matmul
    (separate gate/up, GLM's fused gate_up, a MoE layer's shared expert or attention) peaks at
    `upcast_transient` — the dx upcast (4 B per element) for a frozen weight, the float32 dW
    with its bf16 cast and then that cast with the main_grad hook's float32 copy (6 B) for a
    trained one; a few tokens' activations aside (2 %). Negative control: the other case's
    figure is off by a third or more."""
    args = preset(preset_name, hidden_size=256, intermediate_size=768)
    model = build_model(args, param_dtype="bfloat16", seed=0)
    module, weight = _largest_linear(model, index)
    assert weight.dtype == paddle.bfloat16
    measured = _backward_peak(module, weight, frozen)
    dt = Dtypes.of("float32", "bfloat16")
    assert dt.upcast
    planned = upcast_transient(args, index, dt, frozen=frozen)
    assert measured == pytest.approx(planned, rel=0.02), (measured, planned)
    other = upcast_transient(args, index, dt, frozen=not frozen)
    assert abs(measured / other - 1) > 0.3
    # float32 storage upcasts nothing
    assert upcast_transient(args, index, Dtypes.of("float32", "float32"), frozen=frozen) == 0


def test_weight_copies_are_the_layers_2d_weights_in_bf16() -> None:
    """bf16 O1 autocast over float32 weights (GPU) saves a bf16 copy of every 2-D weight of the
    layer for backward; the stacked routed experts cast themselves and save none; no copy
    under bf16 storage or float32 compute."""
    args = preset("tiny_glm_moe", num_layers=2)
    model = build_model(args, seed=0)
    o1 = Dtypes.of("bfloat16", "float32", device="gpu")
    for index in range(args.num_layers):
        prefix = f"model.layers.{index}."
        params = [(n, p) for n, p in model.named_parameters() if n.startswith(prefix)]
        flat = sum(int(np.prod(p.shape)) for _, p in params if p.ndim == 2)
        stacked = sum(int(np.prod(p.shape)) for _, p in params if p.ndim == 3)
        assert weight_copies(args, index, 128, o1) == flat * 2
        assert stacked > 0 or not args.is_moe_layer(index)
    assert weight_copies(args, 0, 128, Dtypes.of("bfloat16", "bfloat16", device="gpu")) == 0
    assert weight_copies(args, 0, 128, Dtypes.of("float32", "float32", device="gpu")) == 0
