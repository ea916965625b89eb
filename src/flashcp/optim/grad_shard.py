"""ZeRO-2: float32 gradients reduce-scattered into their shard while backward produces them.

Under ZeRO-1 (`flashcp.optim.master_optimizer.MasterOptimizer`) every rank keeps the full
float32 gradient of its stage (`.grad`, or `main_grad` for bf16 storage) until the optimizer
step, and only then reduce-scatters it: 37.6 GiB per rank for GLM-4-9B. Under
`parallel.shard_gradients` a rank never holds more of the full gradient than the bucket being
filled: `GradientSharder` turns each bucket (`flashcp.optim.layout`: the same buckets, shards
and segments as ZeRO-1) into its shard's slice as soon as the backward pass has produced every
gradient of the bucket.

Per trainable parameter, a void backward hook (`Tensor._register_backward_hook`: Paddle runs it
in `GradNodeAccumulation` after the parameter's gradient of ONE backward pass has been
accumulated into `.grad`; every use of the parameter within that pass is summed first, and
the tensor's own gradient hooks - fault injection, user hooks - have run) takes `.grad` and
releases it (`clear_gradient(False)`), so the next backward pass starts from none:

* a parameter sharing its bucket with others is written in float32 into its slot of the
  bucket's flat buffer (zeros at the bucket's first gradient, padded to a multiple of the
  shards like ZeRO-1's; such a bucket is at most `parallel.grad_bucket_mb`); a bf16 gradient
  is cast `piece_numel` elements at a time;
* once every parameter of the bucket has delivered (at once for a parameter alone in its
  bucket, a matrix larger than the bucket size), the bucket is reduce-scattered over the
  part's groups (cp, then dp; the expert-parallel part over edp) with
  `flashcp.distributed.reduce_scatter` (NCCL's own on GPU, the emulated ring on gloo; each wait
  under the collective watchdog) and the slice is added into the bucket's shard gradient (the
  first micro-batch's slice becomes it: with `train.grad_accum` = 1 the sums are ZeRO-1's
  bit for bit). A bucket larger than `piece_numel` goes in pieces: piece j holds every shard's
  j-th sub-range (shard-major, so each level's equal split still sends a rank its own
  shards), cast to float32 from the gradient itself - the float32 copy of a large matrix (the
  LM head: 2.4 GiB for GLM-4-9B) never exists whole. A piece reduces every element in the
  same order as the whole bucket would (the ring sums chunk by chunk; NCCL likewise).

Under reentrant recompute (`flashcp.models.recompute.checkpoint`) a layer's parameters get
their gradients in the nested backward pass of the layer's replay, so the hooks fire layer by
layer during the outer backward. A parameter that delivers twice before its bucket completes
(used by two backward passes of one micro-batch, or a bucket whose last parameter arrives only
in the next micro-batch) has the second gradient added into its slot; the sum is the same, the
bucket is reduced once complete, or at the step: `take` reduce-scatters a bucket still filling
(zeros for parameters that got no gradient), and gives zeros for a bucket that never got one
(what ZeRO-1's reduce-scatter of zeros gives). Parameters named `deferred` (the tied
embedding/head copy of a pipeline stage, summed across stages by the runner after the last
micro-batch) are not hooked: their buckets take ZeRO-1's path at the step.

Collective order. The ranks of one group must issue its collectives in the same order, and the
gradient reduce-scatters now run inside backward, between the attention layers' CP
collectives. Paddle's backward visits nodes in an order fixed by the graph's topology, and
the ranks of a stage's dp × cp group (and of an edp group) run the same graph on different
tokens - no trainable parameter of flashcp's models is used or skipped depending on the data
(stacked experts get a gradient, zero rows for experts without tokens, whenever their layer
runs) - so every rank completes the same buckets at the same point of its backward. A model
that skips a parameter on some ranks only must not use this (the collective watchdog names the
group that then waits).

Memory on a rank (float32 = 4 bytes per element; what `flashcp.plan` counts):

* shard gradients: the part's `layout.numel` float32 elements (its trained elements / shards,
  plus at most shards - 1 of padding per bucket), allocated bucket by bucket during the first
  micro-batch's backward and kept until `MasterOptimizer.clear_grad` after the step;
* while a bucket fills: its padded float32 buffer (at most `parallel.grad_bucket_mb`; buckets
  hold consecutive parameters, which backward delivers together, so about one at a time);
* while a bucket is reduced: its float32 piece (the buffer itself, or a cast copy of at most
  `piece_numel` elements from a large parameter's gradient) and the reduce-scatter's
  temporaries (gloo ring: one piece more; NCCL: the output, 1/(shards) of it), plus the
  parameter's `.grad` being consumed, in its storage dtype (Paddle made it);
* no full-size float32 gradient of a hooked parameter, and no `main_grad`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import paddle
from paddle import _C_ops

from flashcp.distributed import reduce_scatter
from flashcp.optim.layout import Bucket, ShardLayout


@dataclass(frozen=True)
class GradPart:
    """One `MasterShard`'s parameters as the sharder sees them: its layout and the groups its
    buckets are reduce-scattered over, in order (cp then dp; edp for expert parameters)."""

    layout: ShardLayout
    groups: Sequence[Any]


@dataclass
class _BucketState:
    """The running state of one bucket of one part."""

    part: int
    index: int
    bucket: Bucket
    shards: int
    groups: Sequence[Any]
    deferred: bool
    buffer: paddle.Tensor | None = None
    """Float32 `[padded]` of a shared bucket: its gradients so far, until reduced."""
    delivered: set[str] = field(default_factory=set)
    """Parameters whose gradient is in `buffer`."""
    shard: paddle.Tensor | None = None
    """Float32 `[padded / shards]`: the summed gradient slice of this rank's shard."""

    @property
    def padded(self) -> int:
        return self.bucket.padded(self.shards)

    @property
    def single(self) -> bool:
        """One parameter alone in the bucket: reduced straight from its gradient."""
        return len(self.bucket.names) == 1


@dataclass(frozen=True)
class _Slot:
    bucket: _BucketState
    start: int
    size: int


class GradientSharder:
    """Reduce-scatters each bucket of `params`' gradients into this rank's shard as backward
    produces them (module docstring). `parts`: the shard layouts and their groups, one per
    `MasterShard`; `deferred`: names left to the caller (their buckets are not hooked);
    `piece_numel`: float32 elements reduced (and cast) at once."""

    def __init__(
        self,
        params: Mapping[str, paddle.Tensor],
        parts: Sequence[GradPart],
        *,
        deferred: Collection[str] = (),
        piece_numel: int = 16 * 2**20,
    ) -> None:
        self.parts = list(parts)
        self.piece_numel = max(1, int(piece_numel))
        self.buckets: list[list[_BucketState]] = []
        self.slots: dict[str, _Slot] = {}
        self.reductions = 0
        """Bucket reductions so far in this step (during backward, or by `take`)."""
        self._squares: paddle.Tensor | None = None
        self.active = True
        """Hooks work while True (Paddle has no removal of a void backward hook: `remove`)."""
        for i, part in enumerate(self.parts):
            states = []
            for b, bucket in enumerate(part.layout.buckets):
                deferred_ = any(n in deferred for n in bucket.names)
                state = _BucketState(i, b, bucket, part.layout.shards, part.groups, deferred_)
                states.append(state)
                if deferred_:
                    continue
                for name, size, start in zip(bucket.names, bucket.sizes, bucket.starts(),
                                             strict=True):  # fmt: skip
                    self.slots[name] = _Slot(state, start, size)
            self.buckets.append(states)
        for name in self.slots:
            params[name]._register_backward_hook(self._hook(name, params[name]))

    # -- during backward ------------------------------------------------------------------------

    def _hook(self, name: str, p: paddle.Tensor) -> Callable[[], None]:
        slot = self.slots[name]
        # Paddle keeps the hook in C++, out of the garbage collector's sight: a strong reference
        # to the parameter would be a cycle it never frees (the model would outlive the trainer)
        ref = weakref.ref(p)

        @paddle.no_grad()
        def deliver() -> None:
            param = ref()
            if self.active and param is not None:
                self._deliver(name, param, slot)

        return deliver

    def _deliver(self, name: str, p: paddle.Tensor, slot: _Slot) -> None:
        state = slot.bucket
        grad = p.grad
        flat = grad.reshape([-1]) if grad is not None and grad._is_initialized() else None
        if grad is not None:
            # the view `flat` keeps the storage; the parameter holds no gradient any more
            p.clear_gradient(False)
        if state.single:
            self._reduce(state, flat)
            return
        if flat is not None:
            if state.buffer is None:
                state.buffer = paddle.zeros([state.padded], dtype="float32")
            target = state.buffer[slot.start : slot.start + slot.size]
            _write(target, flat, add=name in state.delivered, chunk=self.piece_numel)
        state.delivered.add(name)
        if len(state.delivered) == len(state.bucket.names):
            self._reduce(state, state.buffer)

    def _reduce(self, state: _BucketState, source: paddle.Tensor | None) -> None:
        """Reduce-scatter the bucket's gradient `source` (its elements in bucket order: the
        padded float32 buffer, a single parameter's flat gradient of any dtype, or None for
        zeros) into the shard gradient, `piece_numel` elements at a time."""
        state.buffer = None
        state.delivered = set()
        q = state.padded // state.shards
        step = max(1, self.piece_numel // state.shards)
        shard, first = state.shard, state.shard is None
        if shard is None and q > step:
            shard = paddle.empty([q], dtype="float32")  # written piece by piece below
        for lo in range(0, q, step):
            hi = min(q, lo + step)
            piece = self._piece(state, source, lo, hi)
            square = _C_ops.squared_l2_norm(piece).astype("float64").reshape([])
            self._squares = square if self._squares is None else self._squares + square
            for group in state.groups:
                if int(group.nranks) > 1:
                    piece = reduce_scatter(piece, group)
            if shard is None:  # one piece, the step's first slice: it becomes the shard
                shard = piece
            elif first:
                shard[lo:hi].copy_(piece, False)
            else:
                shard[lo:hi].add_(piece)
        state.shard = shard
        self.reductions += 1

    @staticmethod
    def _piece(
        state: _BucketState, source: paddle.Tensor | None, lo: int, hi: int
    ) -> paddle.Tensor:
        """Float32 `[shards · (hi - lo)]`: elements `[lo, hi)` of every shard's slice of the
        bucket, shard after shard (zeros for padding and a missing gradient)."""
        n, q, real = state.shards, state.padded // state.shards, state.bucket.numel
        if source is None:
            return paddle.zeros([n * (hi - lo)], dtype="float32")
        if (lo, hi) == (0, q) and source.dtype == paddle.float32 and int(source.shape[0]) == n * q:
            return source  # the whole padded buffer (or an exactly fitting float32 gradient)
        parts = []
        for s in range(n):
            a, b = s * q + lo, s * q + hi
            if a < real:
                part = source[a : min(b, real)]
                parts.append(part.astype("float32") if part.dtype != paddle.float32 else part)
            if b > max(a, real):
                parts.append(paddle.zeros([b - max(a, real)], dtype="float32"))
        return paddle.concat(parts) if len(parts) > 1 else parts[0]

    # -- at the step ----------------------------------------------------------------------------

    def deferred(self, part: int, b: int) -> bool:
        """Whether bucket `b` of part `part` is left to the caller (not hooked)."""
        return self.buckets[part][b].deferred

    def take(self, part: int, b: int) -> paddle.Tensor:
        """Bucket `b`'s summed shard gradient of this step, float32 `[layout.piece(b)]`, handed
        over (the sharder keeps no reference). A bucket still filling is reduce-scattered now
        (collective: call for every bucket in order on every rank); one that got no gradient
        is zeros, as ZeRO-1's reduce-scatter of zeros."""
        state = self.buckets[part][b]
        if state.deferred:
            raise ValueError(f"bucket {b} of part {part} is deferred: the caller reduces it")
        if state.delivered:
            self._reduce(state, state.buffer)
        shard = state.shard
        state.shard = None
        if shard is None:
            shard = paddle.zeros([self.parts[part].layout.piece(b)], dtype="float32")
        return shard

    def local_squares(self) -> float:
        """Sum of squares (float64) of this rank's own gradients since the last `reset`: the
        buckets already reduced (each micro-batch's, before the reduction) and those still
        filling. NaN/Inf propagate (the trainer's per-rank non-finite check)."""
        total = 0.0 if self._squares is None else float(self._squares)
        for states in self.buckets:
            for state in states:
                if state.buffer is not None:
                    total += float(_C_ops.squared_l2_norm(state.buffer))
        return total

    def pending(self) -> list[tuple[int, int]]:
        """`(part, bucket)` of the buckets still filling (some parameter delivered)."""
        return [(s.part, s.index) for states in self.buckets for s in states if s.delivered]

    def reset(self) -> None:
        """Forget this step's buffers and shard gradients (after the step, or a skipped one)."""
        for states in self.buckets:
            for state in states:
                state.buffer = None
                state.shard = None
                state.delivered = set()
        self._squares = None
        self.reductions = 0

    def remove(self) -> None:
        """Switch the hooks off for good: the parameters keep their `.grad` as without it."""
        self.active = False
        self.reset()


def _write(target: paddle.Tensor, grad: paddle.Tensor, *, add: bool, chunk: int) -> None:
    """`target` (a float32 view into a bucket buffer) = or += `grad` (flat, any float dtype),
    in place; a non-float32 gradient is cast `chunk` elements at a time."""
    if grad.dtype == paddle.float32:
        if add:
            target.add_(grad)
        else:
            target.copy_(grad, False)
        return
    n = int(grad.shape[0])
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        part = grad[lo:hi].astype("float32")
        view = target[lo:hi] if (lo, hi) != (0, n) else target
        if add:
            view.add_(part)
        else:
            view.copy_(part, False)
