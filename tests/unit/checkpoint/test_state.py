"""Paddle state in checkpoints (`flashcp.checkpoint.state`, `optimizer_state`): model, optimizer
and RNG state round trips between fresh models; a mismatched model state is refused."""

from __future__ import annotations

import json
import random

import numpy as np
import paddle
import pytest

from flashcp.checkpoint.optimizer_state import ClassicSource, classic_arrays
from flashcp.checkpoint.state import load_model_arrays, model_arrays, rng_state, set_rng_state
from flashcp.optim.adamw import adamw_state, load_adamw_state


def _net() -> paddle.nn.Layer:
    nn = paddle.nn
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _step(model: paddle.nn.Layer, opt: paddle.optimizer.Optimizer, x: paddle.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.clear_grad()


def test_model_and_optimizer_state_move_between_fresh_models() -> None:
    paddle.seed(0)
    x = paddle.randn([5, 4])
    a = _net()
    opt_a = paddle.optimizer.AdamW(learning_rate=0.01, parameters=a.parameters())
    for _ in range(3):
        _step(a, opt_a, x)
    pieces = adamw_state(opt_a, [(p, n, 0) for n, p in a.named_parameters()])
    model_state, opt_state = model_arrays(a), classic_arrays(pieces)
    assert any(k.endswith("::moment1_0") for k in opt_state)
    assert all(not k.startswith("linear_") for k in opt_state)  # structured names only
    b = _net()  # Paddle gives its tensors new names
    opt_b = paddle.optimizer.AdamW(learning_rate=0.01, parameters=b.parameters())
    load_model_arrays(b, model_state)
    load_adamw_state(opt_b, [(p, n, 0) for n, p in b.named_parameters()], ClassicSource(opt_state))
    _step(a, opt_a, x)
    _step(b, opt_b, x)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=name)


def test_mismatched_model_state_is_refused() -> None:
    state = model_arrays(_net())
    with pytest.raises(ValueError, match="missing"):
        load_model_arrays(_net(), {k: v for k, v in state.items() if k != "0.weight"})
    bad = dict(state)
    bad["0.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="has shape"):
        load_model_arrays(_net(), bad)


def test_rng_state_round_trip() -> None:
    paddle.seed(11)
    np.random.seed(11)
    random.seed(11)
    state = json.loads(json.dumps(rng_state()))
    assert state["paddle"]["generators"][0]["seed"] == 11
    want = (paddle.randn([3]).numpy(), np.random.rand(3), random.random())
    paddle.seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_state(state)
    got = (paddle.randn([3]).numpy(), np.random.rand(3), random.random())
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]
