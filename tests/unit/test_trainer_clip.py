"""Whole-model gradient clipping for pipeline stages, and the forward-only pipeline plan."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp.distributed import ParallelDims, build_groups
from flashcp.optim.clip import PipelineGlobalNormClip
from flashcp.pipeline.schedule import FORWARD, build_plans, schedule_forward, simulate_plans

SHAPES = [(64, 260), (64,), (64, 64), (256, 64), (3,), (64, 260)]


def _params_grads(seed: int, scale: float) -> list[tuple[paddle.Tensor, paddle.Tensor | None]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[paddle.Tensor, paddle.Tensor | None]] = []
    for i, shape in enumerate(SHAPES):
        p = paddle.create_parameter(list(shape), "float32")
        g = None if (seed % 3 == 0 and i == 2) else rng.standard_normal(shape).astype("float32")
        out.append((p, None if g is None else paddle.to_tensor(g * scale)))
    return out


def _copy(pg):  # type: ignore[no-untyped-def]
    return [(p, None if g is None else g.clone()) for p, g in pg]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [1e-3, 0.5, 3.0])
def test_clip_is_bitwise_paddles_clip_in_one_process(seed: int, scale: float) -> None:
    pg = _params_grads(seed, scale)
    want = paddle.nn.ClipGradByGlobalNorm(1.0)(_copy(pg))
    names = [(f"p{i}", p) for i, (p, _) in enumerate(pg)]
    trivial = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1)).pp
    clip = PipelineGlobalNormClip(
        1.0, global_names=[n for n, _ in names], names=names, group=trivial
    )
    got = clip(_copy(pg))
    assert [p.name for p, _ in got] == [p.name for p, _ in want]  # no-gradient ones dropped
    for (_, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_clip_counts_a_held_copy_once_and_orders_by_the_full_model() -> None:
    pg = _params_grads(1, 2.0)
    names = [(f"p{i}", p) for i, (p, _) in enumerate(pg)]
    trivial = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1)).pp
    # this "stage" holds p0..p2 of a 6-parameter model, and p2 is counted by another stage
    clip = PipelineGlobalNormClip(
        1.0, global_names=[f"p{i}" for i in range(6)], names=names[:3], group=trivial,
        skip=["p2"],
    )  # fmt: skip
    squares = clip.global_squares(pg[:3])
    want = [float(np.sum(np.square(g.numpy()), dtype=np.float32)) for _, g in pg[:2]]
    np.testing.assert_allclose(squares, want, rtol=1e-6)
    with pytest.raises(ValueError, match="not in the full model"):
        PipelineGlobalNormClip(1.0, global_names=["p0"], names=names[:2], group=trivial)


def test_forward_only_plan_streams_micro_batches() -> None:
    assert schedule_forward(3, 2, 1) == [("F", 0), ("F", 1)]
    plans = build_plans(FORWARD, 3, 2)
    assert plans[0] == [("F", 0), ("send_act", 0), ("F", 1), ("send_act", 1)]
    assert plans[2] == [("recv_act", 0), ("F", 0), ("recv_act", 1), ("F", 1)]
    simulate_plans(plans)  # deadlock-free
    assert build_plans(FORWARD, 2, 1)  # fewer micro-batches than stages is fine without backward
    with pytest.raises(ValueError, match=">= 1 micro-batch"):
        schedule_forward(2, 0, 0)
