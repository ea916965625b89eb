"""The optimizer step of every layout: AdamW on the parameters, or on float32 master weights,
optionally sharded over the ranks that hold the same parameters (ZeRO-1), gradients too
(ZeRO-2).

`build_distributed_optimizer(model, train, scheduler, groups)` picks one of two
implementations of one interface (`DistributedOptimizer`: `local_squares`, `reduce_grads`,
`grad_norm`, `step`, `clear_grad`, `full_grads`, `state_pieces`, `load_state`, `describe`).
What they need beyond the model, the config and the groups is derived here, once, from those
(`Trainable`): the trainable parameters, the expert-parallel ones (the model's own
`expert_tensors`, ep > 1), the whole model's parameter order (gathered over the pipeline
stages) and the tied copy another stage counts.

* `ParamOptimizer` - float32 parameters and `parallel.shard_optimizer: false` (the default):
  Paddle's AdamW on the parameters themselves, gradients summed by the bucketed all-reduce over
  cp, then dp (`flashcp.optim.grads.sync_grads`).
* `MasterOptimizer` - a trainable parameter stored in bfloat16/float16, or
  `parallel.shard_optimizer: true`:

  1. gradients accumulate over the micro-batches in float32: `param.main_grad`, written by
     fleet's `MixPrecisionLayer` gradient hooks, for a model with low-precision parameters
     (`attach_main_grad`); float32 parameters otherwise keep `.grad`;
  2. per bucket (`flashcp.optim.layout`) the float32 gradients are flattened and either
     all-reduced over cp, then dp (unsharded: one shard, N = 1) or reduce-scattered over cp,
     then dp (sharded: N = dp·cp), so each rank holds the summed gradient of its shard only,
     added in the same order as the unsharded all-reduce;
  3. the shard's float32 master weights are Paddle Parameters, one per (parameter, shard)
     segment, stepped by Paddle's float32 AdamW (`flashcp.optim.adamw.build_adamw`): its
     update is elementwise, so a segment's update equals the full parameter's, element for
     element; weight decay per parameter as before (matrices and embeddings, not 1-D tensors);
  4. the updated shards are all-gathered per bucket (dp, then cp) and cast into the parameters
     (their storage dtype).

  ZeRO-2 (`shard_gradients`, with `shard` and more than one shard): steps 1-2 move into
  backward - `flashcp.optim.grad_shard.GradientSharder` reduce-scatters each bucket as soon as
  backward has produced its gradients and adds the slice into the shard's float32 gradient,
  so no full-size float32 gradient (nor `main_grad`) is kept; `reduce_grads` only hands the
  summed slices to the masters (reducing a bucket still filling). The buckets, shards and
  segments are ZeRO-1's, and so are the step, the norm and the checkpoints. A tied
  embedding/head held by two pipeline stages keeps ZeRO-1's path (its bucket is summed
  across the stages by the runner after the last micro-batch, before it can be reduced).

Both clip with THE global norm (`flashcp.optim.clip.GlobalNorm`), computed once per step:
`grad_norm()` (the logged value) computes it after `reduce_grads()`, and `step()` scales the
gradients with that same norm before AdamW (Paddle's AdamW gets no `grad_clip`). A shard's
segments are pieces of their parameters, summed over the shard's ranks.

Why own master weights instead of Paddle's `multi_precision`: Paddle 3.3.1's AdamW with
`multi_precision=True` (and fleet's `MixPrecisionOptimizer`) does not step bfloat16 parameters
on CPU ("kernel adamw ... bfloat16 is not registered"), and ZeRO-1 needs masters that exist only
as shards anyway.

Expert parallelism (`parallel.ep` > 1; `flashcp.models.expert_parallel.expert_tensors` names
the expert-parallel tensors): a rank holds only its experts' rows, equal on the dp·cp/ep ranks
of its `edp` group, so those gradients are summed over `edp` alone (bucketed all-reduce, or
reduce-scatter under ZeRO-1, which then shards the expert masters over `edp`:
`MasterOptimizer` keeps two parts, the replicated parameters over dp × cp and the expert
parameters over edp); everything else as above. The global norm adds the experts' squares over
the ep group (each ep rank holds other experts).

State: both optimizers hand out and take in their state in one layout-neutral form, by
parameter and element range of the FULL tensor (`state_pieces` / `load_state`,
`flashcp.optim.adamw.StatePiece` / `OptimizerSource`; an expert tensor's rows are offset by
`Trainable.first_element`), so state saved by any layout loads into any other. How it is laid
out in checkpoint files, and which rank writes which file, is
`flashcp.checkpoint.optimizer_state`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import paddle
from paddle.base.framework import EagerParamBase

from flashcp.config.schema import TrainConfig
from flashcp.device import host_array
from flashcp.distributed import (
    ParallelGroups,
    all_gather_object,
    all_gather_tensor,
    all_reduce_tensor,
    reduce_scatter,
)
from flashcp.models.expert_parallel import ExpertSlice, expert_tensors
from flashcp.optim.adamw import (
    OptimizerSource,
    StatePiece,
    adamw_state,
    build_adamw,
    decay_names,
    load_adamw_state,
)
from flashcp.optim.clip import GlobalNorm, clip_factor
from flashcp.optim.grad_shard import GradientSharder, GradPart
from flashcp.optim.grads import (
    BUCKET_BYTES,
    grad_of,
    numel,
    squared_norm,
    sync_grads,
    trainable,
)
from flashcp.optim.layout import Segment, ShardLayout, shard_layout

LOW_PRECISION = ("bfloat16", "float16")
"""Storage dtypes whose parameters get float32 master weights and float32 `main_grad`."""


def dtype_name(t: paddle.Tensor) -> str:
    """`"float32"`, `"bfloat16"`, ... of a tensor."""
    return str(t.dtype).removeprefix("paddle.")


def low_precision_dtype(params: Sequence[paddle.Tensor]) -> str | None:
    """The low-precision storage dtype among `params` (None: all float32)."""
    found = {dtype_name(p) for p in params} & set(LOW_PRECISION)
    if len(found) > 1:
        raise ValueError(f"trainable parameters mix {sorted(found)}: use one storage dtype")
    return found.pop() if found else None


def attach_main_grad(model: paddle.nn.Layer, dtype: str) -> Any:
    """Float32 gradient accumulation for every parameter of `model`: fleet's
    `MixPrecisionLayer` hooks add each backward's gradient, cast to float32, into
    `param.main_grad` and release the low-precision one (`param.grad` stays None). Returns the
    wrapper (kept only to hold the hooks' owner; the model is used as it is)."""
    # fleet pulls in the whole hybrid-parallel stack: imported only for low-precision storage
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    return MixPrecisionLayer(model, dtype=dtype)


def _holder(params: Sequence[paddle.Tensor]) -> paddle.nn.Layer:
    """A layer holding just `params` (for `attach_main_grad` on some parameters only)."""
    holder = paddle.nn.Layer()
    for i, p in enumerate(params):
        holder.add_parameter(f"p{i}", p)
    return holder


@dataclass(frozen=True)
class Trainable:
    """What an optimizer needs to know about this rank's part of the model (`of`).

    `params`: trainable `(structured name, parameter)` pairs, in the model's order; `experts`:
    the expert-parallel ones (rows of the full tensor; empty at ep = 1); `order`: the whole
    model's trainable names (every pipeline stage's, the optimizer order of one process);
    `skip`: names held here but counted by another stage (the last stage's copy of a tied
    embedding).
    """

    model: paddle.nn.Layer
    params: list[tuple[str, paddle.Tensor]]
    experts: dict[str, ExpertSlice]
    order: list[str]
    skip: set[str]

    @classmethod
    def of(cls, model: paddle.nn.Layer, groups: ParallelGroups) -> Trainable:
        """From the model (this rank's stage) and its groups; collective over pp."""
        params = trainable(model)
        names = [n for n, _ in params]
        experts: dict[str, ExpertSlice] = {}
        if int(groups.ep.nranks) > 1:
            held = set(names)
            experts = {n: s for n, s in expert_tensors(model).items() if n in held}
        order = names
        if int(groups.pp.nranks) > 1:  # stages hold consecutive layers, in stage order
            parts = all_gather_object(names, groups.pp)
            order = list(dict.fromkeys(n for part in parts for n in part))
        tied = getattr(model, "tied_weight", None)
        skip: set[str] = set()
        if tied is not None and not getattr(model, "is_first", True):
            skip = {n for n, p in params if p is tied}
        return cls(model, params, experts, order, skip)

    @cached_property
    def by_name(self) -> dict[str, paddle.Tensor]:
        return dict(self.params)

    def first_element(self, name: str) -> int:
        """Where this rank's elements of parameter `name` start in the full tensor's
        (flattened): an expert-parallel tensor's first row held × elements per row, else 0."""
        piece = self.experts.get(name)
        if piece is None:
            return 0
        return piece.first * (numel(self.by_name[name]) // piece.count)

    def full_numel(self, name: str) -> int:
        """Elements of the full tensor of parameter `name` (all experts)."""
        n = numel(self.by_name[name])
        piece = self.experts.get(name)
        return n if piece is None else piece.total * (n // piece.count)


class DistributedOptimizer(Protocol):
    """The optimizer interface the trainer drives each step (see the module docstring)."""

    def local_squares(self) -> float: ...
    def reduce_grads(self) -> None: ...
    def grad_norm(self) -> float: ...
    def step(self) -> None: ...
    def clear_grad(self) -> None: ...
    def full_grads(self) -> dict[str, np.ndarray]: ...
    def state_pieces(self) -> list[StatePiece]: ...
    def load_state(self, source: OptimizerSource) -> None: ...
    def describe(self) -> str: ...


def build_distributed_optimizer(
    model: paddle.nn.Layer,
    train: TrainConfig,
    scheduler: Any,
    groups: ParallelGroups,
    *,
    shard: bool = False,
    shard_gradients: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
) -> ParamOptimizer | MasterOptimizer:
    """The optimizer of this rank's `model` (its pipeline stage): `ParamOptimizer` for float32
    parameters without sharding, else `MasterOptimizer` (`shard`: ZeRO-1; `shard_gradients`
    too: ZeRO-2). `scheduler`: the LR scheduler (`flashcp.optim.lr.build_scheduler`) or a
    fixed LR. Collective over pp."""
    if shard_gradients and not shard:
        raise ValueError(
            "parallel.shard_gradients: true shards the gradients like the optimizer state, "
            "which needs parallel.shard_optimizer: true"
        )
    held = Trainable.of(model, groups)
    low = low_precision_dtype([p for _, p in held.params])
    if low is None and not shard:
        return ParamOptimizer(held, train, scheduler, groups, bucket_bytes=bucket_bytes)
    return MasterOptimizer(
        held,
        train,
        scheduler,
        groups,
        shard=shard,
        shard_gradients=shard_gradients,
        bucket_bytes=bucket_bytes,
        low_precision=low,
    )


class _NormOnce:
    """The step's global norm, computed once: by `grad_norm()` (the logged value) or, if it
    was not asked for, by `_clip()`, which scales the gradients with it."""

    norm: GlobalNorm
    train: TrainConfig
    _norm: paddle.Tensor | None = None

    def _pieces(self) -> Iterable[tuple[str, paddle.Tensor | None]]:
        """`(structured name, gradient piece)` this rank holds, after `reduce_grads`."""
        raise NotImplementedError

    def _scale(self, factor: paddle.Tensor) -> None:
        """Multiply every gradient `step` uses by `factor`."""
        raise NotImplementedError

    def _step_norm(self) -> paddle.Tensor:
        if self._norm is None:
            self._norm = self.norm(self._pieces())
        return self._norm

    def _forget_norm(self) -> None:
        self._norm = None

    def grad_norm(self) -> float:
        """The global gradient norm (after `reduce_grads`; collective)."""
        return float(self._step_norm())

    @paddle.no_grad()
    def _clip(self) -> None:
        if self.train.grad_clip > 0:
            self._scale(clip_factor(self._step_norm(), self.train.grad_clip))


# -- float32 parameters, unsharded: Paddle's AdamW on the parameters ---------------------------


class ParamOptimizer(_NormOnce):
    """Paddle's AdamW on the (float32) parameters; the classic, default path."""

    shards = 1

    def __init__(
        self,
        held: Trainable,
        train: TrainConfig,
        scheduler: Any,
        groups: ParallelGroups,
        *,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.held = held
        self.train = train
        self.groups = groups
        self.bucket_bytes = bucket_bytes
        self.params = held.params
        self.tensors = [p for _, p in self.params]
        self.dense = [p for n, p in self.params if n not in held.experts]
        self.expert_tensors = [p for n, p in self.params if n in held.experts]
        self.inner = build_adamw(self.tensors, train, scheduler, decay_names(self.tensors))
        self.norm = GlobalNorm(
            held.order,
            skip=held.skip,
            partial={n: [groups.ep] for n in held.experts},
            stages=groups.pp,
        )

    def local_squares(self) -> float:
        """Sum of squares of this rank's own (unreduced) gradients; NaN/Inf propagate."""
        return squared_norm(self.tensors)

    def reduce_grads(self) -> None:
        self._forget_norm()
        g, bucket = self.groups, self.bucket_bytes
        if not self.expert_tensors:
            sync_grads(self.tensors, [g.cp, g.dp], bucket_bytes=bucket)
            return
        sync_grads(self.dense, [g.cp, g.dp], bucket_bytes=bucket)
        sync_grads(self.expert_tensors, [g.edp], bucket_bytes=bucket)

    def _pieces(self) -> Iterable[tuple[str, paddle.Tensor | None]]:
        return ((n, p.grad) for n, p in self.params)

    def _scale(self, factor: paddle.Tensor) -> None:
        for p in self.tensors:
            g = p.grad
            if g is not None:  # in place, as Paddle's clip scales a dense gradient
                g.multiply_(factor if factor.dtype == g.dtype else factor.astype(g.dtype))

    def step(self) -> None:
        """Clip by the global norm, then Paddle's AdamW."""
        self._clip()
        self.inner.step()

    def clear_grad(self) -> None:
        self.inner.clear_grad()
        self._forget_norm()

    def full_grads(self) -> dict[str, np.ndarray]:
        return {n: p.grad.numpy() for n, p in self.params if p.grad is not None}

    def _entries(self) -> list[tuple[paddle.Tensor, str, int]]:
        """`(parameter, name, first element in the full tensor)`: an expert tensor is this
        rank's rows of it."""
        return [(p, n, self.held.first_element(n)) for n, p in self.params]

    def state_pieces(self) -> list[StatePiece]:
        """AdamW's state of every parameter (the parameters are the masters)."""
        return adamw_state(self.inner, self._entries())

    def load_state(self, source: OptimizerSource) -> None:
        """AdamW state from any saved layout."""
        load_adamw_state(self.inner, self._entries(), source)

    def describe(self) -> str:
        return "AdamW on the float32 parameters"


# -- float32 master shards ---------------------------------------------------------------------


def _flat_slice(p: paddle.Tensor, start: int, length: int) -> paddle.Tensor:
    """A float32 copy of elements [start, start + length) of flattened `p`."""
    with paddle.no_grad():
        piece = p.reshape([-1])[start : start + length]
        return piece.astype("float32") if dtype_name(p) != "float32" else piece.clone()


class MasterShard:
    """One rank's float32 master slices of the parameters and Paddle's AdamW over them.

    No communication: the caller hands in each bucket's summed gradient slice (`set_grads`)
    and reads back the updated masters (`piece`). `params` maps structured names to the
    parameters (initial masters are their values, cast to float32).
    """

    def __init__(
        self,
        layout: ShardLayout,
        params: dict[str, paddle.Tensor],
        train: TrainConfig,
        scheduler: Any,
        offsets: Mapping[str, int] | None = None,
    ) -> None:
        self.layout = layout
        self.train = train
        self.segments: list[Segment] = layout.segments()
        self.params = params
        self.offsets = dict(offsets or {})
        """Where a parameter's elements start in the full tensor's (expert rows: the first
        expert held × elements per expert); state goes out and comes in in those coordinates."""
        self.masters: list[paddle.Tensor] = [
            EagerParamBase.from_tensor(_flat_slice(params[seg.name], seg.start, seg.length))
            for seg in self.segments
        ]
        self.decay = {
            m.name
            for seg, m in zip(self.segments, self.masters, strict=True)
            if len(params[seg.name].shape) >= 2
        }
        """Masters with weight decay: those of matrices and embeddings (by the parameter)."""
        self.by_bucket: dict[int, list[int]] = {}
        for i, seg in enumerate(self.segments):
            self.by_bucket.setdefault(seg.bucket, []).append(i)
        self.inner = build_adamw(self.masters, train, scheduler, self.decay)

    def set_grads(self, b: int, piece: paddle.Tensor | None) -> None:
        """Bucket `b`'s summed gradient slice of this shard (`layout.piece(b)` elements) becomes
        the gradient of its segments (a parameter that got no gradient has zeros there and is
        stepped, in every layout: `flashcp.optim.grads.fill_missing_grads`)."""
        for i in self.by_bucket.get(b, []):
            seg = self.segments[i]
            if piece is None:
                self.masters[i].grad = None
            else:
                self.masters[i].grad = piece[seg.piece_offset : seg.piece_offset + seg.length]

    def grads(self) -> Iterable[tuple[str, paddle.Tensor | None]]:
        """`(parameter name, gradient of its segment)` of every segment."""
        return ((seg.name, m.grad) for seg, m in zip(self.segments, self.masters, strict=True))

    @paddle.no_grad()
    def scale_grads(self, scale: paddle.Tensor) -> None:
        for m in self.masters:
            if m.grad is not None:
                m.grad = paddle.multiply(m.grad, scale)

    def step(self) -> None:
        if self.masters:
            self.inner.step()

    def clear_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @paddle.no_grad()
    def piece(self, b: int) -> paddle.Tensor:
        """This shard's slice of bucket `b` from the masters (zeros where it is padding)."""
        parts = [self.masters[i] for i in self.by_bucket.get(b, [])]
        pad = self.layout.piece(b) - sum(self.segments[i].length for i in self.by_bucket.get(b, []))
        if pad:
            parts.append(paddle.zeros([pad], dtype="float32"))
        return paddle.concat(parts) if len(parts) > 1 else parts[0].clone()

    # -- state ------------------------------------------------------------------------------

    def _entries(self) -> list[tuple[paddle.Tensor, str, int]]:
        """`(master, parameter name, its first element in the full tensor)` per segment."""
        starts = [seg.start + self.offsets.get(seg.name, 0) for seg in self.segments]
        names = [seg.name for seg in self.segments]
        return list(zip(self.masters, names, starts, strict=True))

    def state_pieces(self) -> list[StatePiece]:
        """Every segment's master weights and AdamW state."""
        pieces = adamw_state(self.inner, self._entries())
        return [
            StatePiece(p.name, p.start, p.length, {"master": host_array(m), **p.arrays})
            for p, m in zip(pieces, self.masters, strict=True)
        ]

    def load(self, source: OptimizerSource) -> None:
        """Masters and AdamW state of every segment from `source` (any saved layout). Without a
        saved master (an unsharded float32 checkpoint) the master is the parameter's value; a
        parameter without any saved state starts fresh, as Paddle's AdamW would."""
        entries = self._entries()
        for seg, (m, _, start) in zip(self.segments, entries, strict=True):
            master = source.read(seg.name, "master", start, seg.length)
            if master is None:
                master = _flat_slice(self.params[seg.name], seg.start, seg.length).numpy()
            m.set_value(master.astype(np.float32, copy=False))
        load_adamw_state(self.inner, entries, source)


@dataclass
class _Part:
    """The parameters one `MasterShard` covers and the groups its gradients and masters move
    over: the replicated parameters (reduce over cp then dp, gather over dp then cp) or the
    expert-parallel ones (over edp). `pieces`: groups over which the shard's gradients are
    pieces of their parameters (the global norm sums their squares over them)."""

    shard: MasterShard
    reduce: list[Any]
    gather: list[Any]
    pieces: list[Any]

    @property
    def layout(self) -> ShardLayout:
        return self.shard.layout


class MasterOptimizer(_NormOnce):
    """Float32 master weights (sharded over dp × cp when `shard`); module docstring."""

    def __init__(
        self,
        held: Trainable,
        train: TrainConfig,
        scheduler: Any,
        groups: ParallelGroups,
        *,
        shard: bool = False,
        shard_gradients: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        low_precision: str | None = None,
    ) -> None:
        self.held = held
        self.train = train
        g = groups
        self.cp, self.dp, self.pp = g.cp, g.dp, g.pp
        cp_size, dp_size = int(g.cp.nranks), int(g.dp.nranks)
        self.sharded = shard
        self.shards = cp_size * dp_size if shard else 1
        index = int(g.cp.rank) * dp_size + int(g.dp.rank) if shard else 0
        self.low_precision = low_precision
        self.params = dict(held.params)
        self.tensors = [p for _, p in held.params]
        bucket = max(1, bucket_bytes // 4)

        def shard_of(names: list[str], shards: int, at: int, **kw: Any) -> MasterShard:
            layout = shard_layout([(n, numel(self.params[n])) for n in names], shards, at, bucket)
            return MasterShard(layout, self.params, train, scheduler, **kw)

        dense = [n for n, _ in held.params if n not in held.experts]
        self.shard = shard_of(dense, self.shards, index)
        self.layout = self.shard.layout
        """The replicated parameters' shard and layout (all parameters without ep)."""
        pieces = [self.cp, self.dp] if self.sharded else []
        self.parts = [_Part(self.shard, [self.cp, self.dp], [self.dp, self.cp], pieces)]
        self.ep, self.edp = g.ep, g.edp
        if held.experts:
            names = [n for n, _ in held.params if n in held.experts]
            shard_ = shard_of(
                names,
                int(g.edp.nranks) if self.sharded else 1,
                int(g.edp.rank) if self.sharded else 0,
                offsets={n: held.first_element(n) for n in names},
            )
            pieces = ([self.edp] if self.sharded else []) + [self.ep]
            self.parts.append(_Part(shard_, [self.edp], [self.edp], pieces))
        partial = {
            name: part.pieces
            for part in self.parts
            for bucket in part.layout.buckets
            for name in bucket.names
        }
        self.norm = GlobalNorm(held.order, skip=held.skip, partial=partial, stages=self.pp)
        self.sharder: GradientSharder | None = None
        """ZeRO-2 (`shard_gradients`, more than one shard): gradients reduce-scattered during
        backward (`flashcp.optim.grad_shard`); None: at the step."""
        accumulated = self.tensors
        """Parameters whose gradients accumulate whole until the step (`.grad`, `main_grad`)."""
        if shard_gradients and self.shards > 1:
            self.sharder = GradientSharder(
                self.params,
                [GradPart(part.layout, part.reduce) for part in self.parts],
                deferred=self._deferred(g),
                piece_numel=bucket,
            )
            accumulated = [
                self.params[name]
                for i, part in enumerate(self.parts)
                for b, bucket_ in enumerate(part.layout.buckets)
                if self.sharder.deferred(i, b)
                for name in bucket_.names
            ]
        self.accumulated = accumulated
        self.hooks = None
        if low_precision is not None and accumulated:
            whole = accumulated is self.tensors
            self.hooks = attach_main_grad(
                held.model if whole else _holder(accumulated), low_precision
            )

    def _deferred(self, groups: ParallelGroups) -> set[str]:
        """Parameters whose gradient must stay whole until the step under ZeRO-2: a tied
        embedding/head held by two pipeline stages (the runner adds the two stages' gradients
        after the last micro-batch, `flashcp.pipeline.runner.sync_tied_gradients`)."""
        tied = getattr(self.held.model, "tied_weight", None)
        if tied is None or int(groups.pp.nranks) == 1:
            return set()
        return {n for n, p in self.held.params if p is tied}

    # -- gradients --------------------------------------------------------------------------

    def local_squares(self) -> float:
        """Sum of squares of this rank's own (unreduced) float32 gradients; NaN/Inf propagate.
        Under ZeRO-2 the reduced buckets counted each micro-batch's gradients before their
        reduction (`GradientSharder.local_squares`)."""
        if self.sharder is None:
            return squared_norm(self.tensors)
        return self.sharder.local_squares() + squared_norm(self.accumulated)

    @paddle.no_grad()
    def _flat(self, part: _Part, b: int) -> paddle.Tensor:
        bucket = part.layout.buckets[b]
        parts = []
        for name, size in zip(bucket.names, bucket.sizes, strict=True):
            g = grad_of(self.params[name])
            parts.append(
                paddle.zeros([size], "float32") if g is None else g.astype("float32").reshape([-1])
            )
        pad = bucket.padded(part.layout.shards) - bucket.numel
        if pad:
            parts.append(paddle.zeros([pad], "float32"))
        return paddle.concat(parts) if len(parts) > 1 else parts[0].clone()

    @paddle.no_grad()
    def reduce_grads(self) -> None:
        """Sum the gradients over cp, then dp (expert-parallel ones over edp): all of them
        (unsharded), or each rank's shard (reduce-scatter). The parameters' own gradients are
        released bucket by bucket. Under ZeRO-2 the shard gradients were summed during
        backward: a bucket still filling is reduce-scattered here, in bucket order."""
        self._forget_norm()
        for i, part in enumerate(self.parts):
            for b, bucket in enumerate(part.layout.buckets):
                if self.sharder is not None and not self.sharder.deferred(i, b):
                    part.shard.set_grads(b, self.sharder.take(i, b))
                    continue
                flat = self._flat(part, b)
                for name in bucket.names:
                    self._release(self.params[name])
                for group in part.reduce:
                    if int(group.nranks) == 1:
                        continue
                    if self.sharded:
                        flat = reduce_scatter(flat, group)
                    else:
                        all_reduce_tensor(flat, group, inplace=True)
                part.shard.set_grads(b, flat)

    @staticmethod
    def _release(p: paddle.Tensor) -> None:
        if hasattr(p, "main_grad"):
            p.main_grad = None
        if p.grad is not None:
            p.clear_gradient(False)

    def _pieces(self) -> Iterable[tuple[str, paddle.Tensor | None]]:
        return (piece for part in self.parts for piece in part.shard.grads())

    def _scale(self, factor: paddle.Tensor) -> None:
        for part in self.parts:
            part.shard.scale_grads(factor)

    # -- update -----------------------------------------------------------------------------

    @paddle.no_grad()
    def step(self) -> None:
        """Clip by the global norm, AdamW on the master shard, write the parameters back."""
        self._clip()
        for part in self.parts:
            part.shard.step()
        self._write_back()

    @paddle.no_grad()
    def _write_back(self) -> None:
        for part in self.parts:
            for b, bucket in enumerate(part.layout.buckets):
                full = part.shard.piece(b)
                if self.sharded:
                    for group in part.gather:
                        full = all_gather_tensor(full, group)
                starts = bucket.starts()
                for name, size, start in zip(bucket.names, bucket.sizes, starts, strict=True):
                    p = self.params[name]
                    value = full[start : start + size].reshape(list(p.shape))
                    paddle.assign(value.astype(p.dtype) if dtype_name(p) != "float32" else value, p)

    def clear_grad(self) -> None:
        for p in self.tensors:
            self._release(p)
        for part in self.parts:
            part.shard.clear_grads()
        if self.sharder is not None:
            self.sharder.reset()
        self._forget_norm()

    def full_grads(self) -> dict[str, np.ndarray]:
        """The summed gradients by name (unsharded only: a shard holds a slice of them); an
        expert-parallel tensor's are this rank's rows."""
        if self.shards > 1:
            raise ValueError("the full gradients do not exist under parallel.shard_optimizer")
        return {
            seg.name: m.grad.numpy().reshape(self.params[seg.name].shape)
            for part in self.parts
            for seg, m in zip(part.shard.segments, part.shard.masters, strict=True)
            if m.grad is not None
        }

    # -- state ------------------------------------------------------------------------------

    def master_slices(self) -> dict[str, tuple[int, int]]:
        """`[start, stop)` of each flattened parameter this rank holds masters for."""
        segments = [seg for part in self.parts for seg in part.shard.segments]
        return {seg.name: (seg.start, seg.start + seg.length) for seg in segments}

    @paddle.no_grad()
    def set_masters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite the masters of the parameters in `values` (each the float32 elements of
        `master_slices()[name]`), e.g. a checkpoint's own float32 values instead of the
        parameters rounded to their storage dtype."""
        for part in self.parts:
            for seg, m in zip(part.shard.segments, part.shard.masters, strict=True):
                if seg.name in values:
                    value = np.asarray(values[seg.name], np.float32).reshape(-1)
                    if value.size != seg.length:
                        raise ValueError(
                            f"master values of {seg.name!r} have {value.size} elements, this "
                            f"rank holds {seg.length}"
                        )
                    m.set_value(value)

    def state_pieces(self) -> list[StatePiece]:
        """Every segment's master weights and AdamW state: the replicated parameters' shard,
        then the expert parameters' (ep > 1)."""
        return [piece for part in self.parts for piece in part.shard.state_pieces()]

    def load_state(self, source: OptimizerSource) -> None:
        for part in self.parts:
            part.shard.load(source)

    def describe(self) -> str:
        accumulate = "float32 gradient shards" if self.sharder is not None else "float32 main_grad"
        what = "float32 master weights" + (
            f" (parameters stored in {self.low_precision}, {accumulate})"
            if self.low_precision
            else ""
        )
        experts = ""
        if len(self.parts) > 1:
            experts = (
                f"; expert parameters over their edp group of {int(self.edp.nranks)} rank(s)"
                f" ({self.parts[1].layout.owned} elements here)"
            )
        if not self.sharded:
            return f"AdamW on {what}{experts}"
        if self.shards == 1:
            return (
                f"AdamW on {what}; parallel.shard_optimizer: 1 shard (dp × cp = 1: nothing to "
                f"shard){experts}"
            )
        if self.sharder is not None:
            return (
                f"AdamW on {what}, ZeRO-2 sharded over dp × cp = {self.shards} ranks "
                f"({self.layout.owned} of the stage's elements on this rank; gradients "
                f"reduce-scattered during backward){experts}"
            )
        return (
            f"AdamW on {what}, ZeRO-1 sharded over dp × cp = {self.shards} ranks "
            f"({self.layout.owned} of the stage's elements on this rank){experts}"
        )
