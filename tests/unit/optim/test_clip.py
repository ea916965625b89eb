"""THE global gradient norm (`flashcp.optim.clip`) in one process: Paddle's clip bit for bit,
a held copy counted once in the whole model's order, and one computation per optimizer step.

Under expert parallelism and ZeRO-1 (the parts of a tensor summed over groups):
`tests/integration/test_clip_multiproc.py`; pipeline stages: `test_train_pipeline.py`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.config import TrainConfig
from flashcp.distributed import ParallelDims, build_groups
from flashcp.optim.clip import GlobalNorm, clip_factor
from flashcp.optim.optimizer import build_distributed_optimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.trainer import Trainer
from helpers.configs import TINY_LM, Sections, TinyCfg, merged


@pytest.fixture
def tiny_base() -> Sections:
    """Two steps at a tight clip (0.5), no warmup, the schema's `min_lr`."""
    return merged(TINY_LM, train={"steps": 2, "warmup_steps": 0, "grad_clip": 0.5, "min_lr": 3e-5})


SHAPES = [(64, 260), (64,), (64, 64), (256, 64), (3,), (64, 260)]


def _params_grads(
    seed: int, scale: float, shapes: list[tuple[int, ...]] = SHAPES
) -> list[tuple[paddle.Tensor, paddle.Tensor | None]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[paddle.Tensor, paddle.Tensor | None]] = []
    for i, shape in enumerate(shapes):
        p = paddle.create_parameter(list(shape), "float32")
        g = None if (seed % 3 == 0 and i == 2) else rng.standard_normal(shape).astype("float32")
        out.append((p, None if g is None else paddle.to_tensor(g * scale)))
    return out


def _named(pg: list[tuple[paddle.Tensor, Any]]) -> list[tuple[str, Any]]:
    return [(f"p{i}", g) for i, (_, g) in enumerate(pg)]


def _copy(pg):  # type: ignore[no-untyped-def]
    return [(p, None if g is None else g.clone()) for p, g in pg]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [1e-3, 0.5, 3.0])
def test_norm_and_clip_are_bitwise_paddles_clip_in_one_process(seed: int, scale: float) -> None:
    pg = _params_grads(seed, scale)
    want = paddle.nn.ClipGradByGlobalNorm(1.0)(_copy(pg))
    norm = GlobalNorm([f"p{i}" for i in range(len(pg))])(_named(pg))
    assert norm.dtype == paddle.float32 and norm.shape == []
    factor = clip_factor(norm, 1.0)
    got = [(p, paddle.multiply(g, factor)) for p, g in pg if g is not None]
    assert [p.name for p, _ in got] == [p.name for p, _ in want]  # no-gradient ones dropped
    for (_, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # the norm itself: float32 squares summed in float32, in the parameter order
    squares = [np.sum(np.square(g.numpy()), dtype=np.float32) for _, g in pg if g is not None]
    np.testing.assert_allclose(float(norm), np.sqrt(np.sum(squares)), rtol=1e-6)


@pytest.mark.parametrize("count", [1, 9, 40, 130])
def test_many_parameters_sum_like_paddles_clip(count: int) -> None:
    """Paddle's float32 sum of the squares is vectorised: the same order for any count."""
    rng = np.random.default_rng(count)
    shapes = [tuple(int(d) for d in rng.integers(1, 40, size=rng.integers(1, 3)))
              for _ in range(count)]  # fmt: skip
    pg = _params_grads(1, 10.0, shapes)
    want = paddle.nn.ClipGradByGlobalNorm(0.5)(_copy(pg))
    norm = GlobalNorm([f"p{i}" for i in range(count)])(_named(pg))
    for (_, g), (_, w) in zip(pg, want, strict=True):
        np.testing.assert_array_equal((g * clip_factor(norm, 0.5)).numpy(), w.numpy())


def test_a_held_copy_counts_once_in_the_whole_models_order() -> None:
    pg = _params_grads(1, 2.0)
    names = _named(pg)
    # this "stage" holds p0..p2 of a 6-parameter model, and p2 is counted by another stage
    stage = GlobalNorm([f"p{i}" for i in range(6)], skip=["p2"])(names[:3])
    alone = GlobalNorm(["p0", "p1"])(names[:2])
    assert float(stage) == float(alone)
    with pytest.raises(ValueError, match="not in the whole model"):
        GlobalNorm(["p0"])(names[:2])
    with pytest.raises(ValueError, match="given twice"):
        GlobalNorm(["p0", "p1"])([names[0], names[0]])
    assert float(GlobalNorm(["p0"])([("p0", None)])) == 0.0  # no gradient anywhere


@pytest.mark.parametrize("shard", [False, True])
def test_the_norm_is_computed_once_per_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shard: bool,
    tiny_cfg: TinyCfg,
) -> None:
    """One global norm per optimizer step — logged AND clipped with — and each gradient
    squared once: Paddle's AdamW gets no clip of its own (it would square them again)."""
    calls = {"norm": 0, "squares": 0}
    norm_call = GlobalNorm.__call__
    squared = paddle._C_ops.squared_l2_norm

    def counted_norm(self: GlobalNorm, grads: Any) -> Any:
        calls["norm"] += 1
        return norm_call(self, grads)

    def counted_squares(x: paddle.Tensor) -> paddle.Tensor:
        calls["squares"] += 1
        return squared(x)

    monkeypatch.setattr(GlobalNorm, "__call__", counted_norm)
    monkeypatch.setattr(paddle._C_ops, "squared_l2_norm", counted_squares)
    trainer = Trainer(tiny_cfg(tmp_path, parallel={"shard_optimizer": shard}), stream=io.StringIO())
    inner = trainer.optimizer.shard.inner if shard else trainer.optimizer.inner
    assert inner._grad_clip is None
    logged = [trainer.train_step().grad_norm for _ in range(2)]
    assert calls == {"norm": 2, "squares": 2 * len(trainer.params)}, calls
    assert all(v > 0.5 for v in logged)  # the clip was active


def test_param_optimizer_logs_the_norm_it_clips_with() -> None:
    """`grad_norm()` then `step()`: one computation, and the step scales by that norm."""
    paddle.seed(3)
    model = paddle.nn.Linear(16, 8)
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
    opt = build_distributed_optimizer(model, TrainConfig(lr=0.1, grad_clip=0.25), 0.1, groups)
    assert isinstance(opt, ParamOptimizer)
    ref = paddle.nn.Linear(16, 8)
    ref.set_state_dict(model.state_dict())
    ref_opt = paddle.optimizer.AdamW(
        learning_rate=0.1, parameters=ref.parameters(), beta2=0.95, weight_decay=0.1,
        apply_decay_param_fun=lambda n: n == ref.weight.name,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(0.25),
    )  # fmt: skip
    x = paddle.randn([4, 16])
    for net in (model, ref):
        (net(x) ** 2).sum().backward()
    opt.reduce_grads()
    norm = opt.grad_norm()
    grads = [p.grad.numpy().astype(np.float64) for p in model.parameters()]
    assert norm == pytest.approx(np.sqrt(sum(float((g**2).sum()) for g in grads)), rel=1e-6)
    assert norm == opt.grad_norm() > 0.25  # cached, and clipping
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
