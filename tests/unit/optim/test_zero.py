"""The optimizer wrapper in one process: shard layout, shard update == Paddle's AdamW per
element, optimizer-state bytes per shard, bf16 storage with float32 main_grad and masters,
checkpoint shards loaded into any other layout, and the trainer with `parallel.shard_optimizer`.

Multi-process equivalence (CP=2, DP=2×CP=2, PP=2×CP=2) and resharding across launched jobs:
`tests/integration/test_zero_multiproc.py`.
"""

from __future__ import annotations

import gc
import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from paddle.base import core
from safetensors.numpy import save_file

from flashcp.checkpoint.optimizer_state import (
    ClassicSource,
    ShardArrays,
    ShardSource,
    classic_arrays,
    pack_shard,
    source_for,
)
from flashcp.config import TrainConfig, build_config
from flashcp.distributed import ParallelDims, build_groups
from flashcp.optim.adamw import build_adamw, decay_names
from flashcp.optim.layout import group_buckets, shard_layout
from flashcp.optim.master_optimizer import MasterOptimizer
from flashcp.optim.master_shard import MasterShard
from flashcp.optim.optimizer import build_distributed_optimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.optim.trainable import low_precision_dtype
from flashcp.trainer import Trainer
from helpers.bf16toy import Bf16ToyLM
from helpers.configs import TinyCfg
from helpers.trainruns import Fit, losses, nan_model


def _param(shape: list[int], rng: np.random.Generator, dtype: str = "float32") -> paddle.Tensor:
    p = paddle.create_parameter(
        shape, dtype, default_initializer=paddle.nn.initializer.Constant(0.0)
    )
    p.set_value(paddle.to_tensor(rng.normal(size=shape).astype(np.float32)).astype(dtype))
    return p


def _paddle_adamw(
    model: paddle.nn.Layer, train: TrainConfig, lr: float
) -> paddle.optimizer.AdamW:
    """The reference: Paddle's AdamW over `model` as one process builds it (weight decay on
    matrices, Paddle's own global-norm clip when `train.grad_clip` > 0)."""
    decay = {p.name for p in model.parameters() if len(p.shape) >= 2}
    clip = paddle.nn.ClipGradByGlobalNorm(train.grad_clip) if train.grad_clip > 0 else None
    return paddle.optimizer.AdamW(
        learning_rate=lr, parameters=model.parameters(), beta1=train.beta1, beta2=train.beta2,
        epsilon=train.eps, weight_decay=train.weight_decay,
        apply_decay_param_fun=lambda name: name in decay, grad_clip=clip,
    )  # fmt: skip


SHAPES = {"emb": [13, 7], "bias": [11], "mat": [9, 5], "norm": [6]}
"""2-D (weight decay) and 1-D (no weight decay) parameters; 91 + 11 + 45 + 6 = 153 elements."""


def _sizes(shapes: dict[str, list[int]]) -> list[tuple[str, int]]:
    return [(n, int(np.prod(s))) for n, s in shapes.items()]


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_numel", [1, 40, 100, 10_000])
def test_layout_covers_every_element_exactly_once(shards: int, bucket_numel: int) -> None:
    sizes = _sizes(SHAPES)
    layouts = [shard_layout(sizes, shards, i, bucket_numel) for i in range(shards)]
    hits = {n: np.zeros(k, int) for n, k in sizes}
    for lay in layouts:
        segs = lay.segments()
        assert [s.offset for s in segs] == list(np.cumsum([0] + [s.length for s in segs])[:-1])
        assert lay.owned == sum(s.length for s in segs) <= lay.numel
        for s in segs:
            hits[s.name][s.start : s.start + s.length] += 1
            assert s.piece_offset >= 0 and s.piece_offset + s.length <= lay.piece(s.bucket)
    assert all((h == 1).all() for h in hits.values())
    for b, bucket in enumerate(layouts[0].buckets):
        assert bucket.padded(shards) - bucket.numel < shards  # padding < N per bucket
        assert all(lay.piece(b) * shards == bucket.padded(shards) for lay in layouts)


def test_buckets_group_consecutive_parameters() -> None:
    assert group_buckets([5, 5, 20, 1], 10) == [[0, 1], [2], [3]]
    assert group_buckets([], 10) == []
    with pytest.raises(ValueError, match="shard index 2 is outside 0..1"):
        shard_layout([("a", 3)], 2, 2, 10)
    with pytest.raises(ValueError, match="unique"):
        shard_layout([("a", 3), ("a", 4)], 1, 0, 10)


# -- the shard update ---------------------------------------------------------------------------


def _padded_flat(grads: dict[str, np.ndarray], lay: Any, b: int) -> np.ndarray:
    bucket = lay.buckets[b]
    flat = np.concatenate([grads[n].reshape(-1) for n in bucket.names])
    return np.concatenate([flat, np.zeros(bucket.padded(lay.shards) - flat.size, np.float32)])


def _step_shards(
    params: dict[str, paddle.Tensor], grads_per_step: list[dict[str, np.ndarray]], shards: int,
    *, shift: int = 0,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Each of `shards` MasterShards steps its slice; returns the stitched-together masters.
    `shift` takes every slice `shift` elements off (a wrong layout, for the negative control)."""
    train = TrainConfig(weight_decay=0.1, beta2=0.95)
    layouts = [shard_layout(_sizes(SHAPES), shards, i, 40) for i in range(shards)]
    states = [MasterShard(lay, params, train, 0.05) for lay in layouts]
    for grads in grads_per_step:
        for lay, state in zip(layouts, states, strict=True):
            for b in range(len(lay.buckets)):
                flat = np.roll(_padded_flat(grads, lay, b), -shift)
                q, i = lay.piece(b), lay.index
                state.set_grads(b, paddle.to_tensor(flat[i * q : (i + 1) * q]))
            state.step()
            state.clear_grads()
    out = {n: np.zeros(int(np.prod(s)), np.float32) for n, s in SHAPES.items()}
    for state in states:
        for seg, m in zip(state.segments, state.masters, strict=True):
            out[seg.name][seg.start : seg.start + seg.length] = m.numpy()
    return out


def test_shard_update_equals_paddle_adamw_per_element() -> None:
    """A shard boundary falls inside `emb` and `mat` (buckets of 40 elements over 3 shards);
    `bias` and `norm` are excluded from weight decay. Paddle's AdamW is elementwise, so the
    stitched masters equal its update of the whole parameters BITWISE."""
    rng = np.random.default_rng(1)
    params = {n: _param(s, rng) for n, s in SHAPES.items()}
    steps = [{n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
             for _ in range(3)]  # fmt: skip
    lay = shard_layout(_sizes(SHAPES), 3, 0, 40)
    assert any(s.start > 0 or s.length < 91 for s in lay.segments() if s.name == "emb")

    ref_model = paddle.nn.Layer()
    for n, p in params.items():
        copy = paddle.create_parameter(p.shape, "float32")
        copy.set_value(p.numpy())
        ref_model.add_parameter(n, copy)
    train = TrainConfig(weight_decay=0.1, beta2=0.95, grad_clip=0.0)
    ref = _paddle_adamw(ref_model, train, 0.05)
    for grads in steps:
        for n, p in ref_model.named_parameters():
            p.grad = paddle.to_tensor(grads[n])
        ref.step()
        ref.clear_grad()
    want = {n: p.numpy().reshape(-1) for n, p in ref_model.named_parameters()}

    got = _step_shards(params, steps, 3)
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    # negative controls: a slice taken one element off differs everywhere; weight decay on the
    # 1-D tensors too would change them (so the equality above checks the exclusion)
    off = _step_shards(params, steps, 3, shift=1)
    assert all(np.abs(off[n] - want[n]).max() > 1e-3 for n in SHAPES)
    everything = paddle.optimizer.AdamW(
        learning_rate=0.05, parameters=[_param(SHAPES["bias"], rng)], weight_decay=0.1,
        beta2=0.95,
    )  # fmt: skip
    bias = everything._parameter_list[0]
    bias.set_value(params["bias"].numpy())
    for grads in steps:
        bias.grad = paddle.to_tensor(grads["bias"])
        everything.step()
    assert np.abs(bias.numpy() - want["bias"]).max() > 1e-6


def test_shard_state_bytes_are_one_nth_of_unsharded() -> None:
    """Allocator-measured bytes of one rank's optimizer state (float32 masters + both AdamW
    moments + beta powers), after a step: 12 B per owned element, so 1/N of the unsharded
    state plus at most N - 1 padding elements per bucket. Nothing is freed between the
    measurements, and the garbage collector is flushed before and off inside each measured
    window (an earlier test's tensor freed inside it would lower the delta)."""

    def allocated() -> int:
        return int(core.host_memory_stat_current_value("Allocated", 0))

    rng = np.random.default_rng(2)
    shapes = {"a": [257, 301], "b": [301], "c": [401, 129], "d": [7]}
    params = {n: _param(s, rng) for n, s in shapes.items()}
    sizes = _sizes(shapes)
    total = sum(k for _, k in sizes)
    train = TrainConfig()
    keep: list[Any] = []

    def measure(shards: int, index: int) -> tuple[int, Any]:
        lay = shard_layout(sizes, shards, index, 60_000)
        pieces = [paddle.to_tensor(rng.normal(size=lay.piece(b)).astype(np.float32))
                  for b in range(len(lay.buckets))]  # fmt: skip
        keep.append(pieces)
        gc.collect()  # objects of earlier tests freed now, not inside the measured window
        gc.disable()
        try:
            before = allocated()
            state = MasterShard(lay, params, train, 1e-3)
            for b, piece in enumerate(pieces):
                state.set_grads(b, piece)
            state.step()
            state.clear_grads()
            keep.append(state)
            return allocated() - before, lay
        finally:
            gc.enable()

    unsharded, lay1 = measure(1, 0)
    assert 12 * total <= unsharded <= 12 * total + 16 * len(lay1.segments()) + 64
    for shards in (2, 4):
        for index in range(shards):
            got, lay = measure(shards, index)
            pad = (shards - 1) * len(lay.buckets)
            assert got <= unsharded / shards + 12 * pad + 16 * len(lay.segments()) + 64, (
                shards, index, got, unsharded)  # fmt: skip
            assert got >= 12 * lay.owned >= 12 * (total // shards - pad)

    # the default path (AdamW on float32 parameters) holds 8 B per element: no masters
    model = paddle.nn.Layer()
    for n, p in params.items():
        model.add_parameter(n, p)
    for p in params.values():
        p.grad = paddle.zeros_like(p)
    gc.collect()
    gc.disable()
    try:
        before = allocated()
        tensors = list(params.values())
        opt = build_adamw(tensors, TrainConfig(), 1e-3, decay_names(tensors))
        opt.step()
        after = allocated()
    finally:
        gc.enable()
    assert 8 * total <= after - before <= 8 * total + 16 * len(params) + 64


# -- bf16 storage: float32 main_grad and masters ------------------------------------------------


def _trivial_groups() -> Any:
    return build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))


def _toy_optimizer(
    model: paddle.nn.Layer, train: TrainConfig, *, shard: bool = False
) -> ParamOptimizer | MasterOptimizer:
    return build_distributed_optimizer(model, train, train.lr, _trivial_groups(), shard=shard)


def test_bf16_params_get_float32_main_grad_and_masters_stepped_like_adamw() -> None:
    ids = [paddle.to_tensor(np.random.default_rng(s).integers(0, 260, (2, 9))) for s in (0, 1)]
    train = TrainConfig(lr=0.05, weight_decay=0.1, grad_clip=0.0)
    model = Bf16ToyLM()
    opt = _toy_optimizer(model, train)
    assert isinstance(opt, MasterOptimizer) and opt.low_precision == "bfloat16"
    assert "bfloat16" in opt.describe() and "ZeRO" not in opt.describe()

    # reference: float32 copies of the bf16 values; per micro-batch gradient rounded to bf16
    # (the cast's backward returns it in the parameter's dtype), accumulated in float32
    ref = Bf16ToyLM(dtype="float32")
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        q.set_value(p.astype("float32"))
    want_grads: dict[str, np.ndarray] = {}
    for x in ids:
        model.logits(model(x)).sum().backward()
        ref.logits(ref(x)).sum().backward()
        for n, q in ref.named_parameters():
            rounded = q.grad.astype("bfloat16").astype("float32").numpy()
            want_grads[n] = want_grads.get(n, 0) + rounded
            q.clear_gradient(False)
    for n, p in model.named_parameters():
        assert p.grad is None and p.main_grad.dtype == paddle.float32
        np.testing.assert_array_equal(p.main_grad.numpy(), want_grads[n], err_msg=n)
    assert opt.local_squares() == pytest.approx(
        sum(float((g.astype(np.float64) ** 2).sum()) for g in want_grads.values()), rel=1e-6
    )
    opt.reduce_grads()
    assert all(not hasattr(p, "main_grad") or p.main_grad is None for p in model.parameters())
    assert set(opt.full_grads()) == set(want_grads)
    opt.step()
    opt.clear_grad()

    ref_opt = _paddle_adamw(ref, train, train.lr)
    for n, q in ref.named_parameters():
        q.grad = paddle.to_tensor(want_grads[n])
    ref_opt.step()
    masters = {seg.name: m.numpy() for seg, m in zip(opt.shard.segments, opt.shard.masters,
                                                     strict=True)}  # fmt: skip
    for n, q in ref.named_parameters():
        np.testing.assert_array_equal(masters[n], q.numpy().reshape(-1), err_msg=n)
        p = dict(model.named_parameters())[n]
        assert p.dtype == paddle.bfloat16  # storage dtype kept; the value is the cast master
        np.testing.assert_array_equal(
            p.astype("float32").numpy(), q.astype("bfloat16").astype("float32").numpy()
        )
    # the masters keep what bf16 cannot: they are not the parameters' values
    assert any(
        not np.array_equal(masters[n], p.astype("float32").numpy().reshape(-1))
        for n, p in model.named_parameters()
    )


def _copy(params: dict[str, np.ndarray], rng: np.random.Generator) -> paddle.nn.Layer:
    model = paddle.nn.Layer()
    for n, value in params.items():
        p = _param(list(value.shape), rng)
        p.set_value(value)
        model.add_parameter(n, p)
    return model


def test_master_clip_uses_the_global_norm_like_paddles_clip() -> None:
    """Two steps: the first clipped (norm > 1), the second not (norm < 1). Adam is invariant to
    a gradient scale common to every step, so only a scale that changes between steps shows;
    the negative control (no clipping at all) must differ. One process, one shard: the masters'
    segments are the whole parameters, so both optimizers square and sum exactly what Paddle's
    clip does, in its order — their updates are Paddle's BITWISE, and the norm they log is the
    float32 norm that clipped."""
    rng = np.random.default_rng(3)
    init = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    steps = [{n: f * rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
             for f in (3.0, 0.02)]  # fmt: skip
    norms = [math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
             for grads in steps]  # fmt: skip
    assert norms[0] > 5 and norms[1] < 1

    def run(clip: float, shard: bool) -> tuple[list[float], dict[str, np.ndarray]]:
        model = _copy(init, rng)
        opt = _toy_optimizer(model, TrainConfig(lr=0.05, grad_clip=clip), shard=shard)
        seen = []
        for grads in steps:
            for n, p in model.named_parameters():
                p.grad = paddle.to_tensor(grads[n])
            opt.reduce_grads()
            seen.append(opt.grad_norm())
            opt.step()
            opt.clear_grad()
        return seen, {n: p.numpy() for n, p in model.named_parameters()}

    ref = _copy(init, rng)
    ref_opt = _paddle_adamw(ref, TrainConfig(grad_clip=1.0), 0.05)
    for grads in steps:
        for n, p in ref.named_parameters():
            p.grad = paddle.to_tensor(grads[n])
        ref_opt.step()
        ref_opt.clear_grad()
    seen, got = run(1.0, True)
    plain_seen, plain = run(1.0, False)  # ParamOptimizer
    assert seen == plain_seen == pytest.approx(norms, rel=1e-6)
    assert all(float(np.float32(v)) == v for v in seen)  # the float32 norm itself
    _, unclipped = run(0.0, True)
    for n, p in ref.named_parameters():
        np.testing.assert_array_equal(got[n], p.numpy(), err_msg=n)
        np.testing.assert_array_equal(plain[n], p.numpy(), err_msg=n)
        assert np.abs(unclipped[n] - p.numpy()).max() > 1e-3  # negative control: no clip


def test_low_precision_detection_and_choice() -> None:
    rng = np.random.default_rng(4)
    a, b = _param([2], rng), _param([2], rng, "bfloat16")
    assert low_precision_dtype([a]) is None and low_precision_dtype([a, b]) == "bfloat16"
    with pytest.raises(ValueError, match="mix"):
        low_precision_dtype([b, _param([2], rng, "float16")])
    model = paddle.nn.Layer()
    model.add_parameter("a", a)
    train = TrainConfig(grad_clip=0.0)
    assert isinstance(_toy_optimizer(model, train), ParamOptimizer)
    sharded = _toy_optimizer(model, train, shard=True)
    assert isinstance(sharded, MasterOptimizer) and "nothing to shard" in sharded.describe()


# -- checkpoint shards --------------------------------------------------------------------------


def _shard_arrays(state: MasterShard) -> ShardArrays:
    """One master shard's state as its own shard file would hold it."""
    return pack_shard(
        state.state_pieces(),
        numel={n: int(np.prod(p.shape)) for n, p in state.params.items()},
        shards=state.layout.shards,
        index=state.layout.index,
        train=state.train,
    )


def _trained_shards(
    params: dict[str, paddle.Tensor], shards: int, rng: np.random.Generator
) -> list[MasterShard]:
    train = TrainConfig()
    states = []
    for i in range(shards):
        state = MasterShard(shard_layout(_sizes(SHAPES), shards, i, 40), params, train, 0.01)
        for _ in range(2):
            for b in range(len(state.layout.buckets)):
                q = state.layout.piece(b)
                state.set_grads(b, paddle.to_tensor(rng.normal(size=q).astype(np.float32)))
            state.step()
        states.append(state)
    return states


def _full(states: list[MasterShard]) -> dict[str, dict[str, np.ndarray]]:
    """kind -> name -> the whole flattened array, stitched from the shards' saved arrays."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for state in states:
        arrays = _shard_arrays(state)
        for name, start, length, offset in arrays.segments:
            for kind in ("master", "moment1", "moment2"):
                full = out.setdefault(kind, {}).setdefault(
                    name, np.full(int(np.prod(SHAPES[name])), np.nan, np.float32)
                )
                full[start : start + length] = arrays.packed[kind][offset : offset + length]
    return out


def test_shard_files_load_into_any_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    params = {n: _param(s, rng) for n, s in SHAPES.items()}
    saved = _trained_shards(params, 4, rng)
    files = []
    for state in saved:
        arrays = _shard_arrays(state)
        path = tmp_path / f"shard{arrays.index}.safetensors"
        save_file(dict(arrays.tensors()), str(path), metadata=arrays.metadata())
        files.append(path)
    want = _full(saved)
    assert not any(np.isnan(v).any() for kind in want.values() for v in kind.values())
    source = source_for({}, [files])
    assert isinstance(source, ShardSource)
    for shards in (1, 2, 3):  # reshard: 4 → 1, 2, 3
        fresh = {n: _param(s, rng) for n, s in SHAPES.items()}
        states = [MasterShard(shard_layout(_sizes(SHAPES), shards, i, 25), fresh,
                              TrainConfig(), 0.01) for i in range(shards)]  # fmt: skip
        for state in states:
            state.load(source)
        got = _full(states)
        for kind in want:
            for n in SHAPES:
                np.testing.assert_array_equal(got[kind][n], want[kind][n], err_msg=(kind, n))
        b1 = _shard_arrays(states[0]).packed["beta1_pow"]
        assert np.allclose(b1, 0.9**3)  # two steps taken: beta1 ** (1 + 2)

    # shards → the unsharded form (ParamOptimizer) and back
    model = paddle.nn.Layer()
    for n, s in SHAPES.items():
        model.add_parameter(n, _param(s, rng))
    opt = _toy_optimizer(model, TrainConfig(lr=0.01))
    assert isinstance(opt, ParamOptimizer)
    opt.load_state(source)
    classic = classic_arrays(opt.state_pieces())
    assert set(classic) == {f"{n}::{acc}" for n in SHAPES
                            for acc in ("moment1_0", "moment2_0", "beta1_pow_acc_0",
                                        "beta2_pow_acc_0")}  # fmt: skip
    for n, shape in SHAPES.items():
        for kind in ("moment1", "moment2"):
            got_kind = classic[f"{n}::{kind}_0"]
            assert list(got_kind.shape) == shape
            np.testing.assert_array_equal(got_kind.reshape(-1), want[kind][n], err_msg=(kind, n))
        np.testing.assert_allclose(classic[f"{n}::beta1_pow_acc_0"], [0.9**3], rtol=1e-6)
    one = MasterShard(shard_layout(_sizes(SHAPES), 1, 0, 10**6), params, TrainConfig(), 0.01)
    one.load(ClassicSource(classic))
    np.testing.assert_array_equal(_full([one])["moment2"]["emb"], want["moment2"]["emb"])
    for n in SHAPES:
        seg = [i for i, s in enumerate(one.segments) if s.name == n][0]
        np.testing.assert_array_equal(
            one.masters[seg].numpy(), params[n].numpy().reshape(-1)
        )  # an unsharded float32 checkpoint: the parameters are the masters

    # a missing shard file is named, not silently zero-filled
    with pytest.raises(ValueError, match="cover .* a shard file is missing"):
        ShardSource([files[:3]]).read("emb", "moment1", 0, 91)
    with pytest.raises(ValueError, match="not a flashcp optimizer shard"):
        other = tmp_path / "plain.safetensors"
        save_file({"x": np.zeros(2, np.float32)}, str(other))
        ShardSource([[other]])


def test_a_tied_matrix_is_read_from_its_first_stage(tmp_path: Path) -> None:
    """Two stages hold `emb` (tied) with different shard boundaries: read from stage 0 only."""
    rng = np.random.default_rng(6)
    params = {n: _param(s, rng) for n, s in SHAPES.items()}
    stage_files: list[list[Path]] = []
    for stage, bucket in enumerate((40, 17)):
        paths = []
        for i in range(2):
            lay = shard_layout(_sizes(SHAPES), 2, i, bucket)
            arrays = _shard_arrays(MasterShard(lay, params, TrainConfig(), 0.01))
            arrays.packed["moment1"][:] = stage + 1  # tell the stages apart
            path = tmp_path / f"s{stage}_{i}.safetensors"
            save_file(dict(arrays.tensors()), str(path), metadata=arrays.metadata())
            paths.append(path)
        stage_files.append(paths)
    got = ShardSource(stage_files).read("emb", "moment1", 0, 91)
    np.testing.assert_array_equal(got, np.ones(91, np.float32))


# -- the trainer --------------------------------------------------------------------------------


def test_trainer_shard_optimizer_degree_one_and_cross_resume(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    """One process: nothing to shard, but the master path runs: float32 masters and shards of
    one. Same order of every sum as the default path here, so the losses are BITWISE equal, and
    checkpoints move between the two (unsharded ↔ sharded) keeping them so."""
    shard = {"shard_optimizer": True}
    plain = tiny_cfg(tmp_path / "plain", checkpoint={"every": 3})
    fit(plain)
    zero = tiny_cfg(tmp_path / "zero", parallel=shard, checkpoint={"every": 3})
    trainer, _, out = fit(zero)
    assert "parallel.shard_optimizer: 1 shard (dp × cp = 1: nothing to shard)" in out
    assert losses(zero) == losses(plain)
    step3 = Path(zero.run.output_dir) / "checkpoints" / "step_3"
    assert (step3 / "optimizer-00001-of-00001.shard-00001-of-00001.safetensors").is_file()
    assert not (step3 / "optimizer.safetensors").exists()
    # sharded checkpoint → unsharded run, and the reverse
    a = tiny_cfg(tmp_path / "a", checkpoint={"resume": str(step3)})
    fit(a)
    assert losses(a) == losses(plain)[3:]
    plain3 = Path(plain.run.output_dir) / "checkpoints" / "step_3"
    b = tiny_cfg(tmp_path / "b", parallel=shard, checkpoint={"resume": str(plain3)})
    fit(b)
    assert losses(b) == losses(plain)[3:]


def _toy(cfg: Any, stage: Any = None) -> paddle.nn.Layer:
    return Bf16ToyLM(vocab=int(cfg.model.vocab_size), seed=cfg.train.seed)


def test_trainer_bf16_masters_resume_exactly(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    """bf16 storage: the checkpoint carries the float32 masters (a resume from the bf16
    parameters alone would continue from rounded weights); resumed losses are bitwise those of
    the uninterrupted run, sharded (degree 1) or not."""
    for shard in (False, True):
        par = {"shard_optimizer": shard}
        full = tiny_cfg(tmp_path / f"full{shard}", parallel=par)
        trainer, _, out = fit(full, model_factory=_toy)
        assert "bfloat16, float32 main_grad" in out
        assert all(p.dtype == paddle.bfloat16 for _, p in trainer.params)
        ck = {"every": 3}
        first = tiny_cfg(tmp_path / f"b{shard}", parallel=par, checkpoint=ck,
                     run={"stop_after_steps": 3})  # fmt: skip
        t1, _, _ = fit(first, model_factory=_toy)
        state = t1.optimizer.shard
        saved = {s.name: m.numpy() for s, m in zip(state.segments, state.masters, strict=True)}
        second = tiny_cfg(tmp_path / f"b{shard}", parallel=par, checkpoint=ck)
        t2 = Trainer(second, stream=io.StringIO(), model_factory=_toy)
        t2.resume()
        for seg, m in zip(t2.optimizer.shard.segments, t2.optimizer.shard.masters, strict=True):
            np.testing.assert_array_equal(m.numpy(), saved[seg.name])
        t2.fit()
        assert losses(second) == losses(full)


def test_nonfinite_step_is_skipped_under_sharding(tmp_path: Path, tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 3, "on_nonfinite": "skip"},
               parallel={"shard_optimizer": True})  # fmt: skip
    trainer = Trainer(cfg, stream=io.StringIO(), model_factory=lambda c, s: nan_model(c, at=2))
    trainer.train_step()
    before = {n: p.numpy().copy() for n, p in trainer.params}
    masters = [m.numpy().copy() for m in trainer.optimizer.shard.masters]
    skipped = trainer.train_step()
    assert skipped.skipped and math.isnan(skipped.loss)
    for n, p in trainer.params:
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)
    for m, want in zip(trainer.optimizer.shard.masters, masters, strict=True):
        np.testing.assert_array_equal(m.numpy(), want)
    assert all(getattr(p, "grad", None) is None for _, p in trainer.params)
    assert not trainer.train_step().skipped


def test_nonfinite_stop_names_the_step_under_sharding(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    from flashcp.trainer import NonFiniteError

    cfg = tiny_cfg(tmp_path, parallel={"shard_optimizer": True})
    with pytest.raises(NonFiniteError, match=r"at step 2"):
        fit(cfg, model_factory=lambda c, s: nan_model(c, at=2))
    assert os.path.exists(Path(cfg.run.output_dir) / "metrics.jsonl")


def test_lora_dpo_with_sharded_optimizer_resumes_exactly(tmp_path: Path, fit: Fit) -> None:
    """LoRA adapters are the trainable parameters: their masters and moments go to the
    optimizer shard, the adapters to PaddleFormers' files; one process and no clipping, so the
    losses equal the unsharded run's bitwise, through a resume (with clipping as well, in one
    process: `test_master_clip_uses_the_global_norm_like_paddles_clip`)."""
    lora = {"rank": 4, "alpha": 8.0, "target_modules": [".*q_proj", ".*v_proj"]}
    raw = {
        "model": {"preset": "tiny_glm"},
        "data": {"seq_len": 128, "micro_batch_size": 1},
        "train": {"steps": 4, "lr": 3e-3, "warmup_steps": 0, "grad_accum": 2, "grad_clip": 0.0},
        "run": {"recipe": "dpo"},
        "dpo": {"beta": 0.1},
        "lora": lora,
    }

    def cfg(name: str, **extra: Any) -> Any:
        sections = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
        sections["run"] = {**sections["run"], "output_dir": str(tmp_path / name)}
        for key, values in extra.items():
            sections[key] = {**sections.get(key, {}), **values}
        return build_config(sections)

    plain = cfg("plain")
    fit(plain)
    zero = {"shard_optimizer": True}
    ck = {"every": 2}
    fit(cfg("zero", parallel=zero, checkpoint=ck, run={"stop_after_steps": 2}))
    step2 = tmp_path / "zero" / "checkpoints" / "step_2"
    assert (step2 / "adapters" / "peft_model-00001-of-00001.safetensors").is_file()
    shard = step2 / "optimizer-00001-of-00001.shard-00001-of-00001.safetensors"
    names = set(ShardSource([[shard]]).pieces)
    assert names and all("lora_" in n for n in names)  # adapters only
    resumed = cfg("zero", parallel=zero, checkpoint=ck)
    fit(resumed)
    assert losses(resumed) == losses(plain)


def test_incomplete_or_mismatched_saved_state_is_refused() -> None:
    rng = np.random.default_rng(7)
    params = {"w": _param([3, 4], rng)}
    state = MasterShard(shard_layout([("w", 12)], 1, 0, 100), params, TrainConfig(), 0.01)
    with pytest.raises(ValueError, match="optimizer state of 'w' is incomplete"):
        zeros = np.zeros([3, 4], np.float32)
        state.load(ClassicSource({"w::moment1_0": zeros, "w::moment2_0": zeros}))
    with pytest.raises(ValueError, match="has 6 elements, the model's parameter at least 12"):
        state.load(ClassicSource({"w::moment1_0": np.zeros([6], np.float32)}))


def test_init_from_fills_bf16_masters_with_the_files_float32_values(
    tmp_path: Path, tiny_cfg: TinyCfg
) -> None:
    """bf16 storage + `checkpoint.init_from` (a float32 HF checkpoint): the parameters are the
    file's values rounded to bf16, the float32 masters the file's values themselves."""
    from flashcp.models import build_model
    from flashcp.models.hf_save import save_hf_checkpoint
    from flashcp.parallelize import init_weights

    hf = tmp_path / "hf"
    cfg0 = tiny_cfg(tmp_path)
    paddle.seed(11)
    source = build_model(cfg0.model)
    save_hf_checkpoint(source, hf)
    want = {n: p.numpy().reshape(-1) for n, p in source.named_parameters()}
    cfg = tiny_cfg(tmp_path, checkpoint={"init_from": str(hf)})

    def bf16_model(c: Any, stage: Any) -> paddle.nn.Layer:
        model = build_model(c.model, stage=stage, param_dtype="bfloat16")
        init_weights(model, c)
        return model

    trainer = Trainer(cfg, stream=io.StringIO(), model_factory=bf16_model)
    opt = trainer.optimizer
    assert isinstance(opt, MasterOptimizer) and opt.low_precision == "bfloat16"
    rounded = 0
    for seg, m in zip(opt.shard.segments, opt.shard.masters, strict=True):
        np.testing.assert_array_equal(m.numpy(), want[seg.name][seg.start : seg.start + seg.length])
        param = dict(trainer.params)[seg.name].astype("float32").numpy().reshape(-1)
        rounded += int(np.sum(param != m.numpy()))
    assert rounded > 1000  # the bf16 parameters alone would have given other masters
    with pytest.raises(ValueError, match="have 3 elements, this rank holds"):
        opt.set_masters({opt.shard.segments[0].name: np.zeros(3, np.float32)})


def test_a_shard_of_padding_only_steps_saves_and_gathers_zeros() -> None:
    """More shards than elements: shard 3 of 4 over 2 elements owns only padding."""
    rng = np.random.default_rng(8)
    params = {"a": _param([2], rng)}
    state = MasterShard(shard_layout([("a", 2)], 4, 3, 100), params, TrainConfig(), 0.01)
    assert state.segments == [] and state.layout.piece(0) == 1
    state.set_grads(0, paddle.ones([1]))
    state.step()
    np.testing.assert_array_equal(state.piece(0).numpy(), np.zeros(1, np.float32))
    arrays = _shard_arrays(state)
    assert arrays.segments == [] and arrays.packed["master"].size == 0


@pytest.mark.parametrize("shard", [False, True])
def test_a_parameter_without_gradient_is_stepped_as_in_any_layout(shard: bool) -> None:
    """A trainable parameter no target reached this step (a step without targets, an expert no
    token chose) has zeros for a gradient in one process too, and is stepped (weight decay)
    exactly as a multi-rank layout steps the zeros its ranks summed: one process and CP > 1
    stay equal (issue 31)."""
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.Linear(4, 2))
    train = TrainConfig(lr=0.1, weight_decay=0.5, warmup_steps=0)
    optimizer = _toy_optimizer(model, train, shard=shard)
    unused = model[1].weight
    before = unused.numpy().copy()
    model[0](paddle.ones([2, 3])).sum().backward()  # the second layer gets no gradient
    assert unused.grad is None
    optimizer.reduce_grads()
    optimizer.step()
    # AdamW on a zero gradient: no moment update, the decoupled decay alone (lr · wd · p)
    np.testing.assert_allclose(unused.numpy(), before * (1 - 0.1 * 0.5), rtol=1e-6)
