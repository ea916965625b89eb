"""LoRA on the stacked routed experts (PaddleFormers' LoRAMoeExperts, flashcp's grouped compute):
the adapted experts compute with W + A·B·alpha/r per expert (against the old per-expert loop on
those weights), gradients reach only the adapters (against autograd through the merged
weights), and save/load, merge and disable behave as for linear layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle

from bench import numerics
from bench.moe_loop import LoopMoE
from flashcp.lora.model import (
    apply_lora,
    disable_adapters,
    load_adapters,
    lora_layers,
    merge_adapters,
    save_adapters,
)
from flashcp.models import build_model, preset
from flashcp.models.experts import GroupedExperts
from helpers.batches import causal_batch

TARGETS = [r".*mlp\.experts", ".*q_proj"]
PROJ = ("gate_up_proj", "down_proj")
N = preset("tiny_glm_moe").hidden_size
"""The float32 rule's n for merged vs adapted hidden states: the reduction a merged weight's
rounding enters (bench.numerics)."""


def _model(seed: int = 0) -> paddle.nn.Layer:
    model = build_model(preset("tiny_glm_moe", num_layers=3), seed=seed)
    model.eval()
    return model


def _adapted(seed: int = 0, **kw) -> tuple:
    lora = apply_lora(_model(seed), rank=3, alpha=6, target_modules=TARGETS, seed=5, **kw)
    rng = np.random.default_rng(7)
    for _, layer in lora_layers(lora):
        for name, p in layer.named_parameters():
            if name.endswith("lora_B"):
                p.set_value(rng.normal(0, 0.05, p.shape).astype("float32"))
    return lora


def _hidden(model) -> np.ndarray:
    with paddle.no_grad():
        return model(*causal_batch(16)).numpy()


def _experts(lora) -> list[tuple[str, paddle.nn.Layer]]:
    """The adapted experts layers of a LoRAModel's model, by the model's own names."""
    return [(n, layer) for n, layer in lora_layers(lora.model) if n.endswith("mlp.experts")]


def test_adapters_are_stacked_per_expert_and_only_they_train() -> None:
    base = _hidden(_model())
    lora = apply_lora(_model(), rank=3, alpha=6, target_modules=TARGETS, seed=5)
    assert [n for n, _ in _experts(lora)] == [f"model.layers.{i}.mlp.experts" for i in (1, 2)]
    layer = _experts(lora)[0][1]
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    shapes = {n: list(p.shape) for n, p in layer.named_parameters() if "lora" in n}
    assert shapes == {
        "gate_up_proj_lora_A": [e, h, 3],
        "gate_up_proj_lora_B": [e, 3, 2 * i],
        "down_proj_lora_A": [e, i, 3],
        "down_proj_lora_B": [e, 3, h],
    }
    np.testing.assert_array_equal(_hidden(lora), base)  # B = 0: nothing changes yet
    # A keyed per expert (seed, name, expert), uniform within ±1/sqrt(in)
    a = layer.gate_up_proj_lora_A.numpy()
    assert np.abs(a).max() <= 1 / np.sqrt(h) and not np.array_equal(a[0], a[1])
    again = apply_lora(_model(), rank=3, alpha=6, target_modules=TARGETS, seed=5)
    np.testing.assert_array_equal(_experts(again)[0][1].gate_up_proj_lora_A.numpy(), a)
    trainable = {n for n, p in lora.named_parameters() if not p.stop_gradient}
    assert {n for n in trainable if ".experts." in n} == {
        f"model.model.layers.{i}.mlp.experts.{p}_lora_{x}"
        for i in (1, 2)
        for p in PROJ
        for x in "AB"
    }


def _moe(lora) -> paddle.nn.Layer:
    return lora.model.model.layers[1].mlp


def _loop_with_merged_weights(moe, lora_layer) -> LoopMoE:
    """The old loop on W + A·B·s (float64 merge rounded to float32) of the adapted layer."""
    loop = LoopMoE(moe)
    s = float(lora_layer.scaling)
    inter = lora_layer.intermediate_size
    with paddle.no_grad():
        merged = {}
        for p in PROJ:
            w = getattr(lora_layer, p).numpy().astype(np.float64)
            a = getattr(lora_layer, f"{p}_lora_A").numpy().astype(np.float64)
            b = getattr(lora_layer, f"{p}_lora_B").numpy().astype(np.float64)
            merged[p] = (w + np.matmul(a, b) * s).astype(np.float32)
        for e, ex in enumerate(loop.experts):
            ex.gate_proj.weight.set_value(merged["gate_up_proj"][e][:, :inter])
            ex.up_proj.weight.set_value(merged["gate_up_proj"][e][:, inter:])
            ex.down_proj.weight.set_value(merged["down_proj"][e])
    return loop


def test_adapted_experts_compute_the_merged_weights() -> None:
    lora = _adapted()
    _, layer = _experts(lora)[0]
    moe = _moe(lora)
    x = paddle.to_tensor(np.random.default_rng(3).standard_normal((2, 16, 64)).astype("float32"))
    with paddle.no_grad():
        got = moe(x).numpy()
        want = _loop_with_merged_weights(moe, layer)(x).numpy()
        base = LoopMoE(moe)(x).numpy()  # the unadapted weights: negative control
    # the grouped compute vs the per-expert loop: another float32 order, the float32 rule
    numerics.assert_close(got, want, n=N, norm="l2", what="adapted experts")
    numerics.assert_rejects(base, want, n=N, norm="l2")


def test_adapter_gradients_match_autograd_through_the_merged_weights() -> None:
    lora = _adapted()
    _, layer = _experts(lora)[0]
    moe = _moe(lora)
    x = paddle.to_tensor(np.random.default_rng(4).standard_normal((2, 16, 64)).astype("float32"))
    probe = paddle.to_tensor(
        np.random.default_rng(5).standard_normal((2, 16, 64)).astype("float32")
    )
    (moe(x) * probe).sum().backward()
    got = {p: getattr(layer, p).grad for p in layer.state_dict() if "lora" in p}
    # reference: the old per-expert loop with W + A·B·s formed inside autograd
    params = {
        n: paddle.to_tensor(getattr(layer, n).numpy(), stop_gradient=False)
        for n in layer.state_dict()
        if "lora" in n
    }
    s, inter = float(layer.scaling), layer.intermediate_size
    flat = x.reshape([-1, 64])
    ids, weights = moe.gate(flat)
    out = paddle.zeros(flat.shape, dtype="float32")
    for e in range(layer.num_experts):
        hit = ids == e
        tokens = paddle.nonzero(hit.any(axis=-1)).flatten()
        if int(tokens.shape[0]) == 0:
            continue
        w1 = (
            layer.gate_up_proj[e]
            + params["gate_up_proj_lora_A"][e] @ params["gate_up_proj_lora_B"][e] * s
        )
        w2 = layer.down_proj[e] + params["down_proj_lora_A"][e] @ params["down_proj_lora_B"][e] * s
        h = paddle.index_select(flat, tokens) @ w1
        y = (paddle.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2
        wt = paddle.index_select((weights * hit.astype("float32")).sum(-1), tokens)
        out = paddle.index_add(out, tokens, 0, y * wt.unsqueeze(-1))
    (out.reshape(x.shape) * probe).sum().backward()
    tokens = int(flat.shape[0])  # gradients: the float32 rule, n = the tokens summed, ‖·‖₂
    for n, p in params.items():
        numerics.assert_close(got[n].numpy(), p.grad.numpy(), n=tokens, norm="l2", what=n)
    assert layer.gate_up_proj.grad is None and layer.down_proj.grad is None  # frozen base


def test_save_load_merge_disable(tmp_path: Path) -> None:
    base = _hidden(_model())
    lora = _adapted()
    adapted = _hidden(lora)
    numerics.assert_rejects(base, adapted, n=N)  # the adapters matter (negative control)
    with disable_adapters(lora):
        np.testing.assert_array_equal(_hidden(lora), base)
    out = save_adapters(lora, tmp_path / "adapters")
    fresh = load_adapters(_model(), out)
    np.testing.assert_array_equal(_hidden(fresh), adapted)
    merged = merge_adapters(fresh)
    experts = merged.model.layers[1].mlp.experts
    assert type(experts) is GroupedExperts and not lora_layers(merged)
    assert sorted(experts.state_dict()) == sorted(PROJ)
    # merged W + A·B·s vs the adapted forward: another float32 order, the float32 rule
    numerics.assert_close(_hidden(merged), adapted, n=N, what="merged hidden states")


def test_dropout_applies_to_the_adapter_input_only() -> None:
    lora = _adapted(dropout=0.5)
    lora.eval()
    evaluated = _hidden(lora)
    lora.train()
    paddle.seed(3)
    trained = _hidden(lora)
    assert np.abs(trained - evaluated).max() > 0
    with disable_adapters(lora):  # no adapter, no dropout: the base output, train or eval
        np.testing.assert_array_equal(_hidden(lora), _hidden(_model()))


def test_bf16_base_with_expert_adapters_runs_the_float32_math() -> None:
    """bf16-stored frozen experts (upcast per chunk) + float32 adapters = the float32 model
    on the rounded weights, up to float32 rounding."""
    b16 = apply_lora(
        build_model(preset("tiny_glm_moe", num_layers=3), param_dtype="bfloat16", seed=0),
        rank=3,
        alpha=6,
        target_modules=TARGETS,
        seed=5,
    )
    f32 = _adapted(seed=0)
    pairs = zip(b16.named_parameters(), f32.named_parameters(), strict=True)
    with paddle.no_grad():
        for (n16, p16), (n32, p32) in pairs:
            assert n16 == n32
            if p16.stop_gradient:  # frozen base: the rounded values in float32
                assert p16.dtype == paddle.bfloat16
                p32.set_value(p16.astype("float32"))
            else:  # adapters (float32 in both)
                p16.set_value(p32.numpy())
    got, want = _hidden(b16), _hidden(f32)
    numerics.assert_close(got, want, n=N, norm="l2", what="bf16-stored base")  # float32 rule
    # negative control: the unrounded float32 weights give another result
    numerics.assert_rejects(_hidden(_adapted(seed=0)), want, n=N, norm="l2")


def test_merge_then_unmerge_restores_the_stacked_weights() -> None:
    lora = _adapted()
    _, layer = _experts(lora)[0]
    before = {p: getattr(layer, p).numpy().copy() for p in PROJ}
    adapted = _hidden(lora)
    layer.merge()
    assert layer.merged
    merged = _hidden(lora)  # the adapters are in W now (and skipped in forward)
    numerics.assert_close(merged, adapted, n=N, what="merged hidden states")  # as above
    # negative control: merged, but the adapters also applied in forward (counted twice)
    layer.merged = False
    numerics.assert_rejects(_hidden(lora), adapted, n=N)
    layer.merged = True
    during = {p: getattr(layer, p).numpy().copy() for p in PROJ}
    layer.unmerge()
    assert not layer.merged
    for p in PROJ:  # float32 (W + d) - d: two roundings of each element, each within half
        # an ulp of |W + d| (the rule with n = 2, scale = max |W + d|)
        numerics.assert_close(getattr(layer, p).numpy(), before[p], n=2,
                              scale=float(np.abs(during[p]).max()), what=p)  # fmt: skip
