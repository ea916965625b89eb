"""Float32 master weights for low-precision storage or `parallel.shard_optimizer` (ZeRO-1),
gradients sharded in backward with `parallel.shard_gradients` (ZeRO-2): `MasterOptimizer`,
whose steps `flashcp.optim.optimizer`'s docstring lists. One `MasterShard` per part: the
replicated parameters over dp × cp, the expert-parallel ones over edp."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from flashcp.config.schema import TrainConfig
from flashcp.distributed import (
    ParallelGroups,
    all_gather_tensor,
    all_reduce_tensor,
    reduce_scatter,
)
from flashcp.optim.adamw import OptimizerSource, StatePiece
from flashcp.optim.clip import GlobalNorm, NormOnce
from flashcp.optim.grad_shard import GradientSharder, GradPart
from flashcp.optim.grads import BUCKET_BYTES, grad_of, numel, squared_norm
from flashcp.optim.layout import ShardLayout, shard_layout
from flashcp.optim.master_shard import MasterShard
from flashcp.optim.trainable import Trainable, attach_main_grad, dtype_name, holder


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


class MasterOptimizer(NormOnce):
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
                held.model if whole else holder(accumulated), low_precision
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

