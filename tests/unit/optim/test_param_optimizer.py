"""`ParamOptimizer` in one process: which group sums which gradients, where an expert shard's
state starts in its full tensor, gradients released (not zeroed) after a step, and the step
itself bitwise Paddle's AdamW's. The collectives for real:
`tests/integration/test_expert_parallel.py` and `test_clip_multiproc.py`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.config import TrainConfig
from flashcp.optim import param_optimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.optim.trainable import RowSlice, Trainable

GROUPS = SimpleNamespace(
    **{g: SimpleNamespace(name=g, nranks=1) for g in ("dp", "cp", "edp", "ep", "pp")}
)
"""One-rank stand-ins: the calls below are checked by which group they name."""


class _Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.dense = paddle.nn.Linear(3, 3)
        self.experts = self.create_parameter([2, 3])  # rows 2..3 of a [4, 3] expert tensor


def _optimizer(experts: bool, bucket: int = 1234) -> tuple[ParamOptimizer, _Net]:
    paddle.seed(0)
    net = _Net()
    params = list(net.named_parameters())
    held = Trainable(net, params, {"experts": RowSlice(2, 2, 4)} if experts else {},
                     [n for n, _ in params], set())  # fmt: skip
    train = TrainConfig(lr=0.1, grad_clip=0.0)
    return ParamOptimizer(held, train, 0.1, GROUPS, bucket_bytes=bucket), net  # type: ignore[arg-type]


@pytest.mark.parametrize("experts", [False, True])
def test_dense_gradients_sum_over_cp_and_dp_expert_ones_over_edp(
    experts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[list[str], list[str], int]] = []
    names: dict[int, str] = {}

    def record(tensors: list[paddle.Tensor], groups: list[Any], *, bucket_bytes: int) -> None:
        calls.append(([names[id(t)] for t in tensors], [g.name for g in groups], bucket_bytes))

    monkeypatch.setattr(param_optimizer, "sync_grads", record)
    opt, net = _optimizer(experts)
    names.update({id(p): n for n, p in net.named_parameters()})
    opt.reduce_grads()
    every = [n for n, _ in net.named_parameters()]
    dense = [n for n in every if n != "experts"]
    if experts:
        assert calls == [(dense, ["cp", "dp"], 1234), (["experts"], ["edp"], 1234)]
    else:
        assert calls == [(every, ["cp", "dp"], 1234)]


def test_an_expert_shards_state_starts_at_its_first_row() -> None:
    opt, _ = _optimizer(experts=True)
    starts = {piece.name: piece.start for piece in opt.state_pieces()}
    assert starts == {"dense.weight": 0, "dense.bias": 0, "experts": 2 * 3}


def test_a_step_is_paddles_adamw_and_gradients_are_released_after_it() -> None:
    """Bitwise Paddle's AdamW over two steps (matrices decayed, the bias not); after
    `clear_grad` no gradient is held (the next backward writes fresh ones, no zeros to add
    into)."""
    opt, net = _optimizer(experts=False)
    ref = _Net()
    ref.set_state_dict(net.state_dict())
    ref_opt = paddle.optimizer.AdamW(
        learning_rate=0.1, parameters=ref.parameters(), beta2=0.95, weight_decay=0.1,
        apply_decay_param_fun=lambda n: n in (ref.dense.weight.name, ref.experts.name),
    )  # fmt: skip
    x = paddle.randn([4, 3])
    for _ in range(2):
        for model in (net, ref):
            ((model.dense(x) @ model.experts.T) ** 2).sum().backward()
        opt.step()
        ref_opt.step()
        opt.clear_grad()
        ref_opt.clear_grad()
        assert all(p.grad is None for p in net.parameters())
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
