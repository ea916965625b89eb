"""ZeRO-2 (`parallel.shard_gradients`, `flashcp.optim.grad_shard`) in one process.

The sharder's reduce-scatter runs against stand-in groups here: `FakeGroup` ranks whose peers
hold the same gradient, so a reduce-scatter over p ranks returns p × this rank's chunk - exact
in float32 (a power of two), so every shard gradient is compared with `==` against the
independent reference: the slice of the bucket's padded float32 gradients (numpy) that ZeRO-1's
layout (`flashcp.optim.layout`) gives the shard, times dp × cp. Each parity test also checks
that the wrong shard's slice is rejected (a shard-order bug in the pieces would pass a
comparison against itself).

Covered: buckets shared by several parameters and buckets of one large parameter reduced in
pieces (float32 and bfloat16 storage, padding, several micro-batches), the hooks firing during
backward (inside a recompute replay, before the layers below it are replayed), a parameter
that delivers twice, a bucket left partial (flushed with zeros at the step), deferred buckets,
the allocator's bytes (no full-size float32 gradient ever), the per-rank non-finite check
(every gradient, a bucket still filling at the step's end included; through the trainer, a NaN
there skips the step and names the rank), the config rule, and the trainer in one process
(nothing to shard: ZeRO-1's path, bitwise). Real multi-rank runs:
`tests/integration/test_zero2_multiproc.py`.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute

from bench import numerics
from flashcp.config import build_config
from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups, build_groups
from flashcp.metrics import memory
from flashcp.models import build_model
from flashcp.optim import grad_shard
from flashcp.optim.grad_shard import GradientSharder, GradPart
from flashcp.optim.grads import grad_of
from flashcp.optim.layout import ShardLayout, shard_layout
from flashcp.optim.master_optimizer import MasterOptimizer
from flashcp.optim.optimizer import build_distributed_optimizer
from flashcp.optim.trainable import attach_main_grad
from flashcp.problems import ProblemsError
from flashcp.trainer import Trainer
from helpers.configs import Sections, TinyCfg
from helpers.trainruns import Fit, losses


@dataclass
class FakeGroup:
    """A stand-in process group of `nranks` ranks, this process being `rank`; the others hold
    the same gradient (see the module docstring)."""

    nranks: int
    rank: int


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Replace the sharder's reduce-scatter by the FakeGroup arithmetic; records
    `("reduce_scatter", numel)` per call (tests add their own events to the same list)."""
    log: list[tuple[str, int]] = []

    def fake(x: paddle.Tensor, group: FakeGroup) -> paddle.Tensor:
        n = int(x.shape[0])
        assert n % group.nranks == 0
        log.append(("reduce_scatter", n))
        q = n // group.nranks
        return x[group.rank * q : (group.rank + 1) * q] * float(group.nranks)

    monkeypatch.setattr(grad_shard, "reduce_scatter", fake)
    return log


SHAPES = {"a": [5, 3], "b": [7], "big": [9, 6], "c": [4], "d": [2, 2]}
"""15 + 7 + 54 + 4 + 4 elements: with buckets of 24, `big` gets a bucket of its own."""


class Net(paddle.nn.Layer):
    """Every parameter of `SHAPES` takes part in the output (unless `unused`)."""

    def __init__(self, dtype: str = "float32", seed: int = 0, unused: str | None = None):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.unused = unused
        for name, shape in SHAPES.items():
            p = self.create_parameter(shape, dtype=dtype)
            p.set_value(paddle.to_tensor(rng.normal(size=shape).astype(np.float32)).astype(dtype))
            setattr(self, name, p)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        total = paddle.zeros([], "float32")
        for name in SHAPES:
            if name == self.unused:
                continue
            w = getattr(self, name).astype("float32").reshape([-1])
            total = total + paddle.sum(paddle.sin(w * x[: int(w.shape[0])]))
        return total


def _layout(shards: int, index: int, bucket: int = 24) -> ShardLayout:
    return shard_layout([(n, int(np.prod(s))) for n, s in SHAPES.items()], shards, index, bucket)


def _inputs(k: int) -> list[paddle.Tensor]:
    return [paddle.to_tensor(np.random.default_rng(100 + i).normal(size=64).astype(np.float32))
            for i in range(k)]  # fmt: skip


def _plain_grads(dtype: str, xs: list[paddle.Tensor], unused: str | None = None) -> dict:
    """The reference: what ZeRO-1 flattens, as float32 numpy - Paddle's own accumulation in
    `.grad` over the micro-batches (float32), or fleet's float32 `main_grad` (bf16 storage)."""
    net = Net(dtype, unused=unused)
    if dtype != "float32":
        attach_main_grad(net, dtype)
    for x in xs:
        net(x).backward()
    grads = {n: grad_of(getattr(net, n)) for n in SHAPES}
    return {n: g.astype("float32").numpy().reshape(-1) if g is not None
            else np.zeros(int(np.prod(SHAPES[n])), np.float32)
            for n, g in grads.items()}  # fmt: skip


def _expected(grads: dict, layout: ShardLayout, b: int, scale: float, index: int) -> np.ndarray:
    """Shard `index`'s slice of bucket `b`'s padded float32 gradients, times `scale`."""
    bucket = layout.buckets[b]
    flat = np.concatenate([grads[n] for n in bucket.names])
    flat = np.concatenate([flat, np.zeros(bucket.padded(layout.shards) - flat.size, np.float32)])
    q = layout.piece(b)
    return flat[index * q : (index + 1) * q] * np.float32(scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("piece", [5, 10_000])
@pytest.mark.parametrize("micro", [1, 3])
def test_shard_gradients_are_the_layouts_slices_of_the_summed_gradients(
    calls: list, dtype: str, piece: int, micro: int
) -> None:
    """dp 2 × cp 2 (this process: cp rank 1, dp rank 0 → shard 2 of 4); `piece` 5 reduces the
    54-element bucket of `big` (and the shared ones) in pieces, 10_000 in one go."""
    cp, dp = FakeGroup(2, 1), FakeGroup(2, 0)
    index = cp.rank * dp.nranks + dp.rank
    layout = _layout(4, index)
    assert any(len(b.names) == 1 and b.numel > piece for b in layout.buckets) == (piece == 5)
    net = Net(dtype)
    params = {n: getattr(net, n) for n in SHAPES}
    sharder = GradientSharder(params, [GradPart(layout, [cp, dp])], piece_numel=piece)
    xs = _inputs(micro)
    for k, x in enumerate(xs):
        net(x).backward()
        assert all(p.grad is None for p in params.values())  # released in the hook
        assert sharder.reductions == (k + 1) * len(layout.buckets)  # during backward
        assert sharder.pending() == []
    want = _plain_grads(dtype, xs)
    for b in range(len(layout.buckets)):
        got = sharder.take(0, b).numpy()
        assert got.shape == (layout.piece(b),)
        # bitwise by construction: both sides add the micro-batches' float32 gradients in the
        # same order, one rounding per addition, and 4·g1 + 4·g2 + 4·g3 == 4·(g1 + g2 + g3)
        # exactly (scaling by a power of two commutes with rounding)
        np.testing.assert_array_equal(got, _expected(want, layout, b, 4.0, index))
        wrong = _expected(want, layout, b, 4.0, (index + 1) % 4)  # negative control
        numerics.assert_rejects(got, wrong, n=micro, norm="l2", what=f"bucket {b}, wrong shard")
    assert sharder.take(0, 0).abs().max() == 0  # handed over: the next step starts from zero


def test_pieces_give_the_whole_buckets_result_bit_for_bit(calls: list) -> None:
    """Pieces of a bucket reduce every element in the same order as the whole bucket."""
    out = {}
    for piece in (1, 3, 7, 1000):
        cp, dp = FakeGroup(2, 0), FakeGroup(2, 1)
        net = Net("bfloat16")
        layout = _layout(4, 1)
        sharder = GradientSharder({n: getattr(net, n) for n in SHAPES},
                                  [GradPart(layout, [cp, dp])], piece_numel=piece)  # fmt: skip
        for x in _inputs(2):
            net(x).backward()
        out[piece] = [sharder.take(0, b).numpy() for b in range(len(layout.buckets))]
    for piece in (1, 3, 7):
        for got, want in zip(out[piece], out[1000], strict=True):
            np.testing.assert_array_equal(got, want)


class Stack(paddle.nn.Layer):
    """Two linear layers, each under reentrant recompute; `mark` logs when the gradient of the
    hidden state between them is formed (the second layer's replay is done, the first's not
    begun)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.one = paddle.nn.Linear(8, 8)
        self.two = paddle.nn.Linear(8, 8)
        self.log = log

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x.stop_gradient = False
        h = recompute(self.one, x, use_reentrant=True)
        h.register_hook(lambda g: self.log.append(("between", 0)) or g)
        return recompute(self.two, h, use_reentrant=True).sum()


def test_buckets_are_reduced_inside_backward_as_each_layer_is_replayed(calls: list) -> None:
    model = Stack(calls)
    names = [n for n, _ in model.named_parameters()]
    layout = shard_layout([(n, int(np.prod(p.shape))) for n, p in model.named_parameters()],
                          2, 0, 72)  # fmt: skip
    assert [b.names for b in layout.buckets] == [tuple(names[:2]), tuple(names[2:])]
    sharder = GradientSharder(dict(model.named_parameters()), [GradPart(layout, [FakeGroup(2, 0)])])
    model(paddle.ones([3, 8])).backward()
    # layer two's bucket (72 elements, padded to 72) during its replay, layer one's after
    assert calls == [("reduce_scatter", 72), ("between", 0), ("reduce_scatter", 72)]
    assert sharder.reductions == 2


class Twice(paddle.nn.Layer):
    """`w` is used in two recompute blocks (two nested backward passes: it delivers twice);
    `v` only in the first block, in the same bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.w = self.create_parameter([6], default_initializer=paddle.nn.initializer.Constant(0.5))
        self.v = self.create_parameter([6], default_initializer=paddle.nn.initializer.Constant(0.2))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x.stop_gradient = False
        h = recompute(lambda t: paddle.tanh(t * self.w + self.v), x, use_reentrant=True)
        return recompute(lambda t: paddle.sin(t * self.w), h, use_reentrant=True).sum()


def test_a_parameter_delivering_twice_is_added_into_its_slot(calls: list) -> None:
    x = paddle.to_tensor(np.linspace(-1, 1, 6).astype(np.float32))
    plain = Twice()
    plain(x).backward()
    want = np.concatenate([plain.w.grad.numpy(), plain.v.grad.numpy()])
    model = Twice()
    layout = shard_layout([("w", 6), ("v", 6)], 2, 1, 100)
    sharder = GradientSharder({"w": model.w, "v": model.v}, [GradPart(layout, [FakeGroup(2, 1)])])
    model(x).backward()
    assert sharder.reductions == 1  # w twice, then v: complete once
    # the same additions in the same order as Paddle's accumulation: bitwise
    np.testing.assert_array_equal(sharder.take(0, 0).numpy(), want[6:] * 2)
    # alone in its bucket, w is reduced at each delivery and the slices are added
    model = Twice()
    layout = shard_layout([("w", 6), ("v", 6)], 2, 0, 6)
    sharder = GradientSharder({"w": model.w, "v": model.v}, [GradPart(layout, [FakeGroup(2, 0)])])
    model(x).backward()
    assert sharder.reductions == 3
    np.testing.assert_allclose(sharder.take(0, 0).numpy(), want[:3] * 2, rtol=1e-6)


def test_a_bucket_left_partial_is_reduced_at_the_step_with_zeros(calls: list) -> None:
    layout = _layout(2, 1)
    net = Net(unused="c")
    sharder = GradientSharder({n: getattr(net, n) for n in SHAPES},
                              [GradPart(layout, [FakeGroup(2, 1)])])  # fmt: skip
    xs = _inputs(2)
    for x in xs:
        net(x).backward()
    partial = [b for b, bucket in enumerate(layout.buckets) if "c" in bucket.names]
    assert sharder.pending() == [(0, b) for b in partial]
    assert sharder.local_squares() > 0
    want = _plain_grads("float32", xs, unused="c")
    for b in range(len(layout.buckets)):
        got = sharder.take(0, b).numpy()
        np.testing.assert_allclose(got, _expected(want, layout, b, 2.0, 1), rtol=1e-6)
    assert sharder.pending() == []


@pytest.mark.parametrize("poisoned", [None, "d", "a"])
def test_the_nonfinite_check_sees_every_gradient_including_buckets_still_filling(
    calls: list, poisoned: str | None
) -> None:
    """`local_squares` (the trainer's per-rank non-finite check) covers every gradient the
    rank produced: the buckets reduced during backward (a and b's, big's) and the one still
    filling when the step ends (c got no gradient, so c and d's waits in its buffer). Clean, it
    is the float64 sum of squares of Paddle's own gradients; a NaN in d's gradient (filling)
    or a's (reduced) makes it NaN."""
    layout = _layout(2, 1)
    net = Net(unused="c")
    if poisoned is not None:
        getattr(net, poisoned).register_hook(lambda g: g * math.nan)
    sharder = GradientSharder({n: getattr(net, n) for n in SHAPES},
                              [GradPart(layout, [FakeGroup(2, 1)])])  # fmt: skip
    x = _inputs(1)
    net(x[0]).backward()
    (filling,) = [b for b, bucket in enumerate(layout.buckets) if "c" in bucket.names]
    assert sharder.pending() == [(0, filling)] and "d" in layout.buckets[filling].names
    got = sharder.local_squares()
    if poisoned is not None:
        assert math.isnan(got), f"a NaN in {poisoned}'s gradient, local_squares {got}"
        return
    grads = _plain_grads("float32", x, unused="c")
    want = sum(float(np.square(g.astype(np.float64)).sum()) for g in grads.values())
    numerics.assert_close(got, want, n=sum(g.size for g in grads.values()), scale=want,
                          what="local sum of squares")  # fmt: skip


def test_deferred_buckets_are_not_hooked(calls: list) -> None:
    layout = _layout(2, 0)
    net = Net()
    sharder = GradientSharder({n: getattr(net, n) for n in SHAPES},
                              [GradPart(layout, [FakeGroup(2, 0)])], deferred={"b"})  # fmt: skip
    net(_inputs(1)[0]).backward()
    kept = {n for b, bucket in enumerate(layout.buckets) if sharder.deferred(0, b)
            for n in bucket.names}  # fmt: skip
    assert "b" in kept and kept != set(SHAPES)
    assert {n for n in SHAPES if getattr(net, n).grad is not None} == kept
    with pytest.raises(ValueError, match="deferred"):
        sharder.take(0, next(b for b in range(len(layout.buckets)) if sharder.deferred(0, b)))
    sharder.remove()  # switched off: plain accumulation again
    net(_inputs(1)[0]).backward()
    assert all(getattr(net, n).grad is not None for n in SHAPES)


def _loss(x: paddle.Tensor, p: dict[str, paddle.Tensor]) -> paddle.Tensor:
    h = paddle.tanh(paddle.matmul(x, p["w1"].astype("float32")))
    h = paddle.matmul(h, p["w2"].astype("float32")) + p["b"].astype("float32")
    return paddle.matmul(h, p["head"].astype("float32")).sum()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_full_float32_gradient_is_ever_held(calls: list, dtype: str) -> None:
    """Allocator bytes (`flashcp.metrics.memory`) of two micro-batches, against ZeRO-1's
    accumulation of the same model (`.grad`, or fleet's float32 `main_grad` for bf16): after
    backward the rank holds exactly its shard gradients (float32, `layout.numel`), and the
    peak is lower by the full gradient minus the shard, give or take the reduction's
    transients (a piece, its cast, the reduce-scatter's output: at most 3 pieces)."""
    shapes = {"w1": [256, 256], "w2": [256, 256], "b": [256], "head": [256, 1024]}
    full = 4 * sum(int(np.prod(s)) for s in shapes.values())
    layout = shard_layout([(n, int(np.prod(s))) for n, s in shapes.items()], 4, 3, 70_000)
    piece = 20_000
    x = paddle.ones([8, 256], "float32")
    measured = {}
    for zero2 in (False, True):
        layer = paddle.nn.Layer()
        for name, shape in shapes.items():
            layer.add_parameter(name, layer.create_parameter(shape, dtype=dtype))
        p = dict(layer.named_parameters())
        if zero2:
            sharder = GradientSharder(p, [GradPart(layout, [FakeGroup(2, 1), FakeGroup(2, 1)])],
                                      piece_numel=piece)  # fmt: skip
        elif dtype != "float32":
            attach_main_grad(layer, dtype)
        with memory.PeakMeter() as meter:
            for _ in range(2):
                _loss(x, p).backward()
        measured[zero2] = meter
    z1, z2 = measured[False], measured[True]
    assert sharder.reductions == 2 * len(layout.buckets)
    assert z1.end_bytes == full  # ZeRO-1: every float32 gradient, whole
    # ZeRO-2: the shard gradients and the float64 running sum of squares (non-finite check)
    assert z2.end_bytes == 4 * layout.numel + 8
    assert layout.numel < full // 4 // 3  # a quarter, plus < 4 elements of padding per bucket
    saved = z1.peak_bytes - z2.peak_bytes
    assert full - 4 * layout.numel - 3 * 4 * piece <= saved <= full - 4 * layout.numel, (
        z1.peak_bytes,
        z2.peak_bytes,
        full,
        4 * layout.numel,
    )


def test_config_needs_shard_optimizer(tmp_path: Path) -> None:
    raw = {"model": {"preset": "tiny"}, "run": {"output_dir": str(tmp_path)},
           "parallel": {"shard_gradients": True}}  # fmt: skip
    with pytest.raises(ProblemsError) as err:
        build_config(raw)
    text = str(err.value)
    assert "parallel.shard_gradients" in text and "set parallel.shard_optimizer=true" in text
    raw["parallel"]["shard_optimizer"] = True
    assert build_config(raw).parallel.shard_gradients
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
    cfg = build_config(raw)
    with pytest.raises(ValueError, match=r"needs parallel\.shard_optimizer: true"):
        build_distributed_optimizer(Net(), cfg.train, 0.1, groups, shard_gradients=True)


ZERO2: Sections = {
    "model": {"preset": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64, "micro_batch_size": 1},
    "train": {"steps": 4, "lr": 3e-3, "warmup_steps": 1, "seed": 0, "grad_accum": 2},
    "parallel": {"shard_optimizer": True},
}
"""The tiny GPT, two micro-batches per step, the optimizer sharded (ZeRO-1)."""


@pytest.fixture
def tiny_base() -> Sections:
    return ZERO2


def test_trainer_one_process_has_nothing_to_shard(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    """dp × cp = 1: one shard, so ZeRO-2 has nothing to reduce and takes ZeRO-1's path (no
    hooks); bitwise ZeRO-1's losses."""
    z1 = tiny_cfg(tmp_path / "z1")
    fit(z1)
    z2 = tiny_cfg(tmp_path / "z2", parallel={"shard_gradients": True})
    trainer, _, out = fit(z2)
    assert isinstance(trainer.optimizer, MasterOptimizer) and trainer.optimizer.sharder is None
    assert "nothing to shard" in out
    assert losses(z1) == losses(z2)


def _spare_norm_model(cfg: Any, stage: Any) -> paddle.nn.Layer:
    """The configured model with one more trainable parameter on the final norm that no
    forward uses: its bucket (with the last layer's MLP bias and the norm's own) is still
    filling when the step ends."""
    model = build_model(cfg.model, stage=stage)
    norm = model.model.norm
    norm.spare = norm.create_parameter([8])
    return model


def test_trainer_skips_a_step_whose_nan_waits_in_a_filling_bucket(
    tmp_path: Path, tiny_cfg: TinyCfg, calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's non-finite check (`MasterOptimizer.local_squares`, per rank) through a
    ZeRO-2 optimizer whose NaN sits in a bucket still filling at the step's end: the step is
    skipped, its update never starts, and the warning names the rank. The optimizer is cp
    rank 1 of 2 (`FakeGroup` reduce-scatters; one process cannot hold a real second rank);
    the trainer's own groups are one process's, so the rank it names is 0."""
    cfg = tiny_cfg(tmp_path, train={"on_nonfinite": "skip"})
    trainer = Trainer(cfg, stream=io.StringIO(), model_factory=_spare_norm_model)
    cp = NamedGroup("cp", 1, 5, [0, 1], pg=None)
    groups = ParallelGroups(ParallelDims(dp=1, pp=1, cp=2, world_size=2), 1,
                            NamedGroup("world", 1, 0, [0, 1], pg=None),
                            NamedGroup("dp", 0, -1, [1], pg=None),
                            NamedGroup("pp", 0, -1, [1], pg=None), cp, "none")  # fmt: skip
    opt = build_distributed_optimizer(
        trainer.model, cfg.train, trainer.scheduler, groups, shard=True, shard_gradients=True,
        bucket_bytes=1200,
    )  # fmt: skip
    assert opt.sharder is not None
    (filling,) = [b for b, bucket in enumerate(opt.layout.buckets)
                  if "model.norm.spare" in bucket.names]  # fmt: skip
    assert {"model.norm.weight", "model.norm.bias"} < set(opt.layout.buckets[filling].names)
    checked: list[list[tuple[int, int]]] = []  # the buckets still filling at the check
    squares = opt.local_squares
    monkeypatch.setattr(
        opt, "local_squares", lambda: checked.append(opt.sharder.pending()) or squares()
    )
    updates: list[str] = []  # a step that is not skipped reduces, takes the norm and steps
    for name in ("reduce_grads", "grad_norm", "step"):
        monkeypatch.setattr(opt, name, lambda name=name: updates.append(name) or 0.0)
    trainer.optimizer = opt
    dict(trainer.params)["model.norm.weight"].register_hook(lambda g: g * math.nan)
    before = {n: p.numpy().copy() for n, p in trainer.params}
    m = trainer.train_step()
    assert checked == [[(0, filling)]] and calls  # the other buckets reduced during backward
    assert m.skipped and updates == [], updates
    assert math.isfinite(m.loss)  # the loss was fine: the gradients alone were caught
    warning = "non-finite gradients on rank(s) 0 at step 1: update skipped"
    assert warning in trainer.stream.getvalue()
    for n, p in trainer.params:
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)
    assert opt.sharder.pending() == []  # the skipped step's buffers are forgotten
