"""LoRA through PaddleFormers on flashcp models: training, merge, disable, save/load, errors."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.lora.model import (
    apply_lora,
    disable_adapters,
    load_adapters,
    lora_layers,
    merge_adapters,
    save_adapters,
    trainable_parameters,
)
from flashcp.models import build_model, preset
from flashcp.models.layers import Linear
from helpers.batches import causal_batch

TARGETS = [".*q_proj", ".*v_proj"]


def _model(name: str = "tiny_glm", seed: int = 0):
    paddle.seed(seed)
    model = build_model(preset(name))
    model.eval()
    return model


def _randomize_adapters(lora, seed: int = 2) -> None:
    """Give every B a non-zero value (B starts at zero, which would make adapters invisible)."""
    rng = np.random.default_rng(seed)
    for _, layer in lora_layers(lora):
        layer.lora_B.set_value(rng.normal(0, 0.05, layer.lora_B.shape).astype("float32"))


def _run(model) -> np.ndarray:
    with paddle.no_grad():
        return model.logits(model(*causal_batch())).numpy()


def test_only_adapters_train_and_get_gradients() -> None:
    lora = apply_lora(_model(), rank=4, alpha=8, target_modules=TARGETS)
    names = [n for n, p in lora.named_parameters() if not p.stop_gradient]
    assert len(names) == 2 * 2 * 2  # layers x targets x (A, B)
    assert all(n.endswith(("lora_A", "lora_B")) for n in names)
    assert all(("q_proj" in n) or ("v_proj" in n) for n in names)
    _randomize_adapters(lora)
    ids, positions, attn = causal_batch()
    hidden = lora(ids, positions, attn)
    labels = paddle.concat([ids[:, 1:], paddle.full([2, 1], -100, "int64")], axis=1)
    (-lora.token_logprobs(hidden, labels).mean()).backward()
    for name, p in lora.named_parameters():
        has_grad = p.grad is not None and bool(np.any(p.grad.numpy() != 0))
        assert has_grad == name.endswith(("lora_A", "lora_B")), name


def test_frozen_base_unchanged_after_adamw_steps() -> None:
    lora = apply_lora(_model(), rank=4, alpha=8, dropout=0.1, target_modules=TARGETS)
    lora.train()
    before = {n: p.numpy().copy() for n, p in lora.named_parameters()}
    # the optimizer sees every parameter (with weight decay): frozen ones must still not move
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=lora.parameters(), weight_decay=0.1)
    ids, positions, attn = causal_batch()
    labels = paddle.concat([ids[:, 1:], paddle.full([2, 1], -100, "int64")], axis=1)
    for _ in range(3):
        loss = -lora.token_logprobs(lora(ids, positions, attn), labels).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
    for n, p in lora.named_parameters():
        moved = not np.array_equal(before[n], p.numpy())
        assert moved == n.endswith(("lora_A", "lora_B")), n
    assert len(trainable_parameters(lora)) == 8


def test_disabled_adapters_equal_base_model() -> None:
    base_out = _run(_model())
    lora = apply_lora(_model(), rank=4, alpha=8, target_modules=TARGETS)
    _randomize_adapters(lora)
    with_adapters = _run(lora)
    assert np.abs(with_adapters - base_out).max() > 1e-3
    with disable_adapters(lora) as ref:
        np.testing.assert_array_equal(_run(ref), base_out)
    np.testing.assert_array_equal(_run(lora), with_adapters)  # restored on exit


def test_merge_equals_base_plus_adapters() -> None:
    base_keys = {k: list(v.shape) for k, v in _model().state_dict().items()}
    lora = apply_lora(_model(), rank=4, alpha=16, target_modules=[".*_proj"])
    _randomize_adapters(lora)
    with_adapters = _run(lora)
    merged = merge_adapters(lora)
    assert not lora_layers(merged)
    projections = [layer for name, layer in merged.named_sublayers() if name.endswith("proj")]
    assert projections and all(type(layer) is Linear for layer in projections)
    assert all(not p.stop_gradient for p in merged.parameters())
    # same parameter names and shapes as the base model (no extra zero biases)
    assert {k: list(v.shape) for k, v in merged.state_dict().items()} == base_keys
    # merged W + A·B·s vs the adapted forward, another float32 order: the float32 rule
    # (bench.numerics), n = the hidden size (the reduction a merged weight's rounding enters)
    n = preset("tiny_glm").hidden_size
    numerics.assert_close(_run(merged), with_adapters, n=n, what="merged logits")
    # negative control: the base model without the adapters
    numerics.assert_rejects(_run(_model()), with_adapters, n=n)


def test_save_then_load_into_fresh_model(tmp_path) -> None:
    lora = apply_lora(_model(), rank=2, alpha=4, target_modules=[".*o_proj", ".*down_proj"])
    _randomize_adapters(lora)
    expect = _run(lora)
    out = save_adapters(lora, tmp_path / "adapters")
    assert (out / "lora_config.json").is_file()
    config = json.loads((out / "config.json").read_text())  # names the HF model, not flashcp's
    assert config["architectures"] == ["Glm4ForCausalLM"] and config["num_hidden_layers"] == 2
    assert list(out.glob("*.safetensors"))
    fresh = load_adapters(_model(), out)  # same base weights (seed), new adapters loaded
    # bitwise by construction: the same base weights (seed), the adapters' float32 values
    # through safetensors unchanged, the same forward in the same process
    np.testing.assert_array_equal(_run(fresh), expect)
    assert sorted(n for n, p in fresh.named_parameters() if not p.stop_gradient) == sorted(
        n for n, p in lora.named_parameters() if not p.stop_gradient
    )


def test_moe_experts_can_be_targeted() -> None:
    """Routed experts are one stacked layer per MoE block (more in test_experts.py)."""
    lora = apply_lora(_model("tiny_glm_moe"), rank=2, alpha=2, target_modules=[r".*mlp\.experts"])
    names = [n for n, _ in lora_layers(lora.model)]
    assert names == ["model.layers.1.mlp.experts"]
    assert _run(lora).shape[-1] == 260
    with pytest.raises(ValueError, match=r"routed experts \('\.\*mlp"):
        apply_lora(_model("tiny_glm_moe"), rank=2, alpha=2, target_modules=[".*experts.*"])


def test_errors_are_clear(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"pattern '\.\*nope_proj' matches no layer"):
        apply_lora(_model(), rank=4, alpha=8, target_modules=[".*q_proj", ".*nope_proj"])
    with pytest.raises(ValueError, match="WHOLE name"):
        apply_lora(_model(), rank=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="not an nn.Linear"):
        apply_lora(_model(), rank=4, alpha=8, target_modules=[".*self_attn"])
    with pytest.raises(ValueError, match="not a regex"):
        apply_lora(_model(), rank=4, alpha=8, target_modules=["(q_proj"])
    with pytest.raises(ValueError, match="rank must be"):
        apply_lora(_model(), rank=0, alpha=8, target_modules=TARGETS)
    # pipeline stages pool their matches: a pattern need only match on some stage
    from flashcp.lora.model import check_targets, target_summary
    from flashcp.pipeline.stage import build_stage

    stages = [build_stage(preset("tiny_glm"), s, 2, seed=0) for s in range(2)]
    head = ["lm_head", ".*q_proj"]
    assert check_targets([target_summary(st, head) for st in stages]) == head
    with pytest.raises(ValueError, match=r"pattern 'lm_head' matches no layer"):
        check_targets([target_summary(stages[0], head)])
    with pytest.raises(ValueError, match=r"matches 'model.norm' \(RMSNorm\), which is not"):
        check_targets([target_summary(st, ["model.norm", ".*q_proj"]) for st in stages])
    lora = apply_lora(_model(), rank=4, alpha=8, target_modules=TARGETS)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(lora.model, rank=4, alpha=8, target_modules=TARGETS)
    with pytest.raises(FileNotFoundError, match="lora_config.json is missing"):
        load_adapters(_model(), tmp_path)
    lora.merge()
    with pytest.raises(RuntimeError, match="cannot be disabled"), disable_adapters(lora):
        pass
