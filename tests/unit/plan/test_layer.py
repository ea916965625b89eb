"""The per-layer terms of the memory plan (`flashcp.plan.layer`) against Paddle's allocator."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.lora.model import apply_lora
from flashcp.models import build_model, preset
from flashcp.optim.trainable import attach_main_grad, holder
from flashcp.plan import activations as act
from flashcp.plan import plan
from flashcp.plan.counts import Counts, Dtypes
from flashcp.plan.layer import upcast_transient, weight_copies
from flashcp.plan.moe_rows import ExpertRows
from helpers.configs import PLANNED, Sections, TinyCfg
from helpers.kept import allocated_by, forward_kept


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


@pytest.fixture
def tiny_base() -> Sections:
    return PLANNED


KEPT_CASES = [
    ({"preset": "tiny_glm", "recompute": "full"}, None),
    ({"preset": "tiny_glm", "recompute": "refined"}, None),
    ({"preset": "tiny_llama", "recompute": "full"}, [".*q_proj", ".*down_proj"]),
    # the first layer's frozen input: nothing but a frozen weight reads the embedding output
    ({"preset": "tiny_glm"}, [".*q_proj", ".*gate_up_proj"]),
    ({"preset": "tiny_qwen3"}, [".*k_proj", ".*o_proj", ".*up_proj"]),
]


@pytest.mark.parametrize(("model", "lora"), KEPT_CASES,
                         ids=["full", "refined", "full-lora", "lora", "qwen3-lora"])  # fmt: skip
def test_forward_keeps_what_the_plan_says_per_mode(
    model: dict[str, Any], lora: list[str] | None, tiny_cfg: TinyCfg
) -> None:
    """What a CPU float32 forward leaves for backward under full and refined recompute (each
    layer's output; refined: with its attention output and LSE) and with LoRA adapters (their
    rank-r inputs; the frozen first layer's input kept by nothing) equals the plan's
    `forward: loss` activations to one float per token. Negative control: the plan of another
    recompute mode, or (without recompute) without LoRA, is off by more than that."""
    sections: dict[str, Any] = {"model": model, "data": {"micro_batch_size": 2, "seq_len": 128}}
    if lora:
        sections |= {"run": {"recipe": "sft"}, "lora": {"rank": 4, "target_modules": lora}}
    cfg = tiny_cfg(**sections)
    planned = plan(cfg).ranks[0].moments["forward: loss"]["activations"]
    built = build_model(cfg.model, seed=0)
    if lora:
        apply_lora(built, rank=4, alpha=8.0, target_modules=lora, seed=0)
    B, S = 2, 128
    tokens = B * S
    measured = forward_kept(built, cfg.model.vocab_size, B, S)
    assert abs(measured - planned) <= 4 * tokens, (measured, planned)
    others = [m for m in ("none", "full", "refined") if m != cfg.model.recompute]
    for other in others:
        wrong = tiny_cfg(**{**sections, "model": {**model, "recompute": other}})
        off = plan(wrong).ranks[0].moments["forward: loss"]["activations"]
        assert abs(measured - off) > 4 * tokens, other
    if lora and cfg.model.recompute == "none":  # recomputed layers keep their outputs only
        bare = tiny_cfg(model=model, data=sections["data"])
        off = plan(bare).ranks[0].moments["forward: loss"]["activations"]
        assert abs(measured - off) > 4 * tokens


@pytest.mark.parametrize("numpy_ops", [True, False], ids=["numpy-ops", "paddle-ops"])
@pytest.mark.parametrize(
    "preset_name",
    ["tiny_glm", "tiny_llama", "tiny_qwen3", "tiny", "tiny_ernie", "tiny_qwen2", "tiny_glm_moe",
     "tiny_qwen3_moe"],
)  # fmt: skip
def test_layer_saved_per_family_with_numpy_and_paddle_ops(
    preset_name: str, numpy_ops: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one more decoder layer keeps for backward (a 3-layer forward less a 2-layer one)
    is `layer_saved` of that layer, to one float per token: with the numpy RMSNorm and rotary
    (CPU float32) and with Paddle's own ops — the GPU path's saved set at float32 (sandwich
    norms, QK-norm keeping its float32 input and rotary slices of its output, LayerNorm, biases,
    a MoE layer at the expert buffer it laid out). Negative control: the other path's plan
    misses it for every family."""
    from flashcp.models import cpu_elementwise, experts

    if not numpy_ops:
        monkeypatch.setattr(cpu_elementwise, "applies", lambda *tensors: False)
    layouts: list[Any] = []
    original = experts.plan_layout

    def spy(*a: Any) -> Any:
        layouts.append(original(*a))
        return layouts[-1]

    monkeypatch.setattr(experts, "plan_layout", spy)
    B, S = 2, 128

    def kept(layers: int) -> int:
        layouts.clear()
        model = build_model(preset(preset_name, num_layers=layers), seed=0)
        return forward_kept(model, 256, B, S)

    args = preset(preset_name, num_layers=3)
    three = kept(3)
    rows = None
    if args.is_moe_layer(2):  # the last layer's buffer as laid out (layers 0-1 route alike)
        lay = layouts[-1]
        rows = ExpertRows(lay.rows / (B * S), lay.rows > sum(lay.counts), 0, 0)
    per_layer = three - kept(2)
    dt = Dtypes(c=4, res=4, param=4, gpu=not numpy_ops)
    assert dt.numpy_elementwise == numpy_ops
    planned = act.layer_saved(args, 2, dt, rows).bytes(dt) * B * S
    assert abs(per_layer - planned) <= 4 * B * S, (per_layer, planned)
    other = Dtypes(c=4, res=4, param=4, gpu=numpy_ops)
    missed = act.layer_saved(args, 2, other, rows).bytes(other) * B * S
    assert abs(per_layer - missed) > 4 * B * S


def test_qk_norm_on_bf16_heads_keeps_a_float32_copy() -> None:
    """bf16 compute (the GPU path): Paddle's RMSNorm over bf16 q/k heads keeps a float32 copy
    of its input, its bf16 normalised output and the float32 rsqrt, not the bf16 input — the
    `layer_saved` QK-norm parts besides its output (which rotary keeps), to 1 %."""
    args = preset("tiny_qwen3")
    model = build_model(args, param_dtype="bfloat16", seed=0)
    attn = dict(model.named_sublayers())["model.layers.0.self_attn"]
    T, hd = 512, args.head_size
    core = paddle.base.core
    measured = 0
    for norm, heads in ((attn.q_norm, args.num_heads), (attn.k_norm, args.num_kv_heads)):
        x = paddle.randn([T, heads, hd]).astype("bfloat16")
        x.stop_gradient = False
        gc.collect()
        before = core.host_memory_stat_current_value("Allocated", 0)
        y = norm(x)
        measured += core.host_memory_stat_current_value("Allocated", 0) - before - 2 * y.size
        del y
    dt = Dtypes.of("bfloat16", "bfloat16", device="gpu")
    parts = Counts()
    for what, cls, n in act.layer_saved(args, 0, dt).parts:
        if what.startswith("q/k QK-norm") and "output" not in what:
            parts.add(what, cls, n)
    assert measured == pytest.approx(parts.bytes(dt) * T, rel=0.01)
    # negative control: the input counted in bf16 (the q/k projections, as before) misses
    # the float32 copy
    q_kv = (args.num_heads + args.num_kv_heads) * hd
    assert abs(measured - (parts.bytes(dt) - 2 * q_kv) * T) > 0.1 * measured


@pytest.mark.parametrize(
    ("preset_name", "recompute"),
    [("tiny_glm", "none"), ("tiny_glm", "full"), ("tiny_glm", "refined"), ("tiny_qwen3", "none"),
     ("tiny_qwen3", "refined"), ("tiny", "none")],
)  # fmt: skip
def test_gpu_plan_forward_keeps_what_paddle_ops_keep(
    preset_name: str, recompute: str, monkeypatch: pytest.MonkeyPatch, tiny_cfg: TinyCfg
) -> None:
    """The GPU plan at float32 compute (`plan(cfg, device="gpu")`): its `forward: loss`
    activations are what a forward through Paddle's own norm and rotary ops — the GPU path's
    code, run here on the CPU — leaves for backward, exactly, per recompute mode (the final
    norm holding the last layer's output, QK-norm, LayerNorm). Negative control: the CPU plan
    (numpy ops) of the same config differs."""
    from flashcp.models import cpu_elementwise

    monkeypatch.setattr(cpu_elementwise, "applies", lambda *tensors: False)
    B, S = 2, 128
    cfg = tiny_cfg(
        model={"preset": preset_name, "recompute": recompute},
        data={"micro_batch_size": B, "seq_len": S},
        train={"dtype": "float32"},
    )
    planned = plan(cfg, device="gpu").ranks[0].moments["forward: loss"]["activations"]
    measured = forward_kept(build_model(cfg.model, seed=0), cfg.model.vocab_size, B, S)
    assert abs(measured - planned) <= 4 * B * S, (measured, planned)
    on_cpu = plan(cfg, device="cpu").ranks[0].moments["forward: loss"]["activations"]
    assert abs(measured - on_cpu) > 4 * B * S


@pytest.mark.parametrize("numpy_ops", [True, False], ids=["numpy-ops", "paddle-ops"])
@pytest.mark.parametrize("preset_name", ["tiny_glm", "tiny_glm_moe", "tiny"])
def test_mtp_block_input_keeps_what_the_plan_says(
    preset_name: str, numpy_ops: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An MTP depth's input (`mtp_block_input`: enorm of the embedding, hnorm of the hidden
    states, their concat through eh_proj) keeps `mtp_input_saved` for backward, to one float
    per token: RMSNorm on numpy's and on Paddle's ops, GPT's LayerNorm (its input and
    mean/var). Negative control: for RMSNorm the other path's count, for LayerNorm RMSNorm's."""
    from flashcp.models import cpu_elementwise
    from flashcp.models.mtp import is_mtp_layer, mtp_block_input

    if not numpy_ops:
        monkeypatch.setattr(cpu_elementwise, "applies", lambda *tensors: False)
    args = preset(preset_name, num_layers=1, mtp_layers=1, mtp_loss_weight=0.3)
    layer = next(m for m in build_model(args, seed=0).sublayers() if is_mtp_layer(m))
    B, S = 2, 128
    hidden = paddle.randn([B, S, args.hidden_size])
    hidden.stop_gradient = False
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (B, S)))
    kept = allocated_by(lambda: mtp_block_input(layer, hidden, ids))[0]
    dt = Dtypes(c=4, res=4, param=4, gpu=not numpy_ops)
    assert abs(kept - act.mtp_input_saved(args, dt).bytes(dt) * B * S) <= 4 * B * S
    if args.family.norm == "layer":
        rms = preset("tiny_glm", hidden_size=args.hidden_size)
        other = act.mtp_input_saved(rms, dt).bytes(dt) * B * S
    else:
        flipped = Dtypes(c=4, res=4, param=4, gpu=numpy_ops)
        other = act.mtp_input_saved(args, flipped).bytes(flipped) * B * S
    assert abs(kept - other) > 4 * B * S
