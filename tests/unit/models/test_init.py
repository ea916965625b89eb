"""Deterministic, layout-independent init (`flashcp.models.init`): a parameter's initial value
depends on (seed, its name) and its rule only — not on the block size, the build order, the
pipeline layout or the storage dtype — and follows its rule's distribution."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from flashcp.lora.model import apply_lora, lora_layers
from flashcp.models import build_model, preset
from flashcp.models import init as model_init
from flashcp.models.init import InitRule, fill_parameter, generator, init_parameters


def _weights(model: paddle.nn.Layer) -> dict[str, np.ndarray]:
    return {n: p.astype("float32").numpy() for n, p in model.named_parameters()}


def test_values_are_keyed_by_seed_and_name_only(monkeypatch: pytest.MonkeyPatch) -> None:
    args = preset("tiny_glm_moe", num_layers=3)
    want = _weights(build_model(args, seed=5))
    # the block size only cuts one stream into pieces
    monkeypatch.setattr(model_init, "INIT_BLOCK", 100)
    got = _weights(build_model(args, seed=5))
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the value of a name is its generator's stream under its rule
    name = "model.layers.2.self_attn.q_proj.weight"
    std = np.float32(args.initializer_range)
    direct = generator(5, name).standard_normal(want[name].size, dtype=np.float32) * std
    np.testing.assert_array_equal(want[name].reshape(-1), direct)
    # a stacked expert weight: expert e's slice is the stream of "<name>.<e>"
    name = "model.layers.2.mlp.experts.down_proj"
    for e in (0, 3):
        piece = want[name][e]
        direct = generator(5, f"{name}.{e}").standard_normal(piece.size, dtype=np.float32) * std
        np.testing.assert_array_equal(piece.reshape(-1), direct)
    # other seed, other values; norms are ones, biases zeros, whatever the seed
    other = _weights(build_model(args, seed=6))
    assert not np.array_equal(other[name], want[name])
    assert not np.array_equal(want[name][0], want[name][1])  # experts differ
    np.testing.assert_array_equal(other["model.norm.weight"], np.ones(64, np.float32))
    np.testing.assert_array_equal(
        other["model.layers.0.self_attn.q_proj.bias"], np.zeros(64, np.float32)
    )


def test_normal_rule_has_its_std_and_names_differ() -> None:
    model = build_model(preset("small"), seed=0)
    w = {n: p.numpy() for n, p in model.named_parameters()}
    q0, q1 = (w[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    # n ≈ 2.6e5 draws: the sample std is within ~3/sqrt(2n) relative of 0.02
    assert abs(q0.std() / 0.02 - 1) < 3 / math.sqrt(2 * q0.size)
    assert abs(q0.mean()) < 4 * 0.02 / math.sqrt(q0.size)
    assert abs(np.corrcoef(q0.reshape(-1), q1.reshape(-1))[0, 1]) < 4 / math.sqrt(q0.size)


def test_bf16_storage_holds_the_float32_values_rounded() -> None:
    args = preset("tiny_glm")
    f32 = build_model(args, seed=3)
    b16 = build_model(args, param_dtype="bfloat16", seed=3)
    for (name, p), (name2, q) in zip(f32.named_parameters(), b16.named_parameters(), strict=True):
        assert name == name2 and q.dtype == paddle.bfloat16
        np.testing.assert_array_equal(q.numpy(), p.astype("bfloat16").numpy(), err_msg=name)


def test_lora_adapters_are_keyed_and_match_paddleformers_distribution() -> None:
    """A: uniform in ±1/sqrt(in) (PaddleFormers' KaimingUniform(sqrt(5), leaky_relu)), keyed
    by name so a stage gets the whole model's adapters; B zeros."""
    targets = [".*q_proj", ".*down_proj"]
    whole = build_model(preset("tiny_glm", num_layers=2), seed=0)
    apply_lora(whole, rank=8, alpha=16, target_modules=targets, seed=11)
    from flashcp.pipeline.stage import build_stage

    last = build_stage(preset("tiny_glm", num_layers=2), 1, 2, seed=0)
    apply_lora(last, rank=8, alpha=16, target_modules=targets, seed=11, require_match=False)
    got = {n: p.numpy() for n, p in last.named_parameters() if not p.stop_gradient}
    want = {n: p.numpy() for n, p in whole.named_parameters() if not p.stop_gradient}
    assert got and set(got) < set(want)
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for _, layer in lora_layers(whole):
        a, fan_in = layer.lora_A.numpy(), int(layer.lora_A.shape[0])
        assert np.abs(a).max() <= 1 / math.sqrt(fan_in)
        assert not np.any(layer.lora_B.numpy())
    # the bound is PaddleFormers' own: its initializer on a large [in, r] tensor reaches it
    big = paddle.create_parameter(
        [256, 4096],
        "float32",
        default_initializer=paddle.nn.initializer.KaimingUniform(
            negative_slope=math.sqrt(5), nonlinearity="leaky_relu"
        ),
    )
    ours = paddle.create_parameter([256, 4096], "float32")
    fill_parameter(ours, 0, "x.lora_A", InitRule("uniform", 1 / math.sqrt(256)))
    for t in (big.numpy(), ours.numpy()):
        assert abs(np.abs(t).max() * math.sqrt(256) - 1) < 1e-3
        assert abs(t.std() * math.sqrt(3 * 256) - 1) < 0.01  # uniform: std = bound / sqrt(3)


def test_a_parameter_without_a_rule_is_refused() -> None:
    layer = paddle.nn.Linear(4, 4)  # Paddle's own initializers record no rule
    with pytest.raises(ValueError, match="parameter weight has no recorded init rule"):
        init_parameters(layer, 0)
    with pytest.raises(ValueError, match="init rule kind 'gamma'"):
        InitRule("gamma")


def test_layers_built_outside_build_model_keep_paddles_random_init() -> None:
    from flashcp.models.layers import linear

    paddle.seed(0)
    a = linear(8, 8, bias=True, std=0.02).weight.numpy()
    paddle.seed(0)
    b = linear(8, 8, bias=True, std=0.02).weight.numpy()
    np.testing.assert_array_equal(a, b)
    assert 0.005 < a.std() < 0.05  # random (not the constant fill of a deferred build)
    u = paddle.create_parameter([64, 64], "float32", attr=model_init.uniform_attr(0.1)).numpy()
    assert 0.09 < np.abs(u).max() <= 0.1
    assert getattr(paddle.create_parameter([2], "float32", attr=model_init.ones_attr()),
                   model_init.RULE_ATTR) == InitRule("ones")  # fmt: skip
