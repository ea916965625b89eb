"""The optimizer step of every layout: AdamW on the parameters, or on float32 master weights,
optionally sharded over the ranks that hold the same parameters (ZeRO-1).

`build_distributed_optimizer(setup)` picks one of two implementations of one interface
(`local_squares`, `reduce_grads`, `grad_norm`, `step`, `clear_grad`, `full_grads`,
`describe`; their state is saved and restored by `flashcp.checkpoint.optimizer_state`):

* `ParamOptimizer` - float32 parameters and `parallel.shard_optimizer: false` (the default):
  Paddle's AdamW on the parameters themselves, gradients summed by the bucketed all-reduce over
  cp, then dp (`flashcp.optim.grads.sync_grads`), Paddle's global-norm clip (the whole
  model's norm over pipeline stages: `flashcp.optim.clip`). Operation for operation the
  trainer's step from before this module.
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
     segment, stepped by Paddle's float32 AdamW: its update is elementwise, so a segment's
     update equals the full parameter's, element for element; weight decay per parameter as
     before (matrices and embeddings, not 1-D tensors);
  4. clipping: the sum of squares of the shard's gradients, all-reduced over the shard's ranks
     and the pipeline stages (a tied matrix's second copy left out), is the global norm;
  5. the updated shards are all-gathered per bucket (dp, then cp) and cast into the parameters
     (their storage dtype).

Why own master weights instead of Paddle's `multi_precision`: Paddle 3.3.1's AdamW with
`multi_precision=True` (and fleet's `MixPrecisionOptimizer`) does not step bfloat16 parameters
on CPU ("kernel adamw ... bfloat16 is not registered"), and ZeRO-1 needs masters that exist only
as shards anyway.

Expert parallelism (`parallel.ep` > 1; `OptimizerSetup.experts` names the expert-parallel
tensors, `flashcp.models.expert_parallel`): a rank holds only its experts' rows, equal on the
dp·cp/ep ranks of its `edp` group, so those gradients are summed over `edp` alone (bucketed
all-reduce, or reduce-scatter under ZeRO-1, which then shards the expert masters over `edp`:
`MasterOptimizer` keeps two parts, the replicated parameters over dp × cp and the expert
parameters over edp); everything else as above. The global norm adds the experts' squares over
the ep group (each ep rank holds other experts). Expert masters are saved in the FULL tensors'
element coordinates (`MasterShard.offsets`; `flashcp.checkpoint.optimizer_state`), so the shard
files of a stage cover every expert once and load into any ep; without ZeRO-1 each ep rank's
first edp rank writes its experts' file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import paddle
from paddle import _C_ops
from paddle.base.framework import EagerParamBase

from flashcp.config.schema import TrainConfig
from flashcp.distributed import (
    ParallelGroups,
    all_gather_tensor,
    all_reduce_tensor,
    reduce_scatter,
)
from flashcp.models.expert_parallel import ExpertSlice
from flashcp.optim.adamw import build_optimizer
from flashcp.optim.grads import all_reduce_values, squared_norm, sync_grads
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
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    return MixPrecisionLayer(model, dtype=dtype)


def grad_of(p: paddle.Tensor) -> paddle.Tensor | None:
    """The accumulated gradient of `p`: its float32 `main_grad` when hooked, else `.grad`."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def _numel(p: paddle.Tensor) -> int:
    return int(np.prod(p.shape)) if len(p.shape) else 1


@dataclass
class OptimizerSetup:
    """What the optimizer of one rank needs from the trainer.

    `params`: this rank's trainable `(structured name, parameter)` pairs in a fixed order;
    `global_names`: the full model's trainable names (pipeline clipping order); `shared`: names
    held here but counted by another stage (the last stage's tied embedding copy).
    """

    model: paddle.nn.Layer
    params: list[tuple[str, paddle.Tensor]]
    train: TrainConfig
    scheduler: Any
    groups: ParallelGroups
    shard: bool = False
    bucket_bytes: int = 64 * 2**20
    global_names: list[str] = field(default_factory=list)
    shared: set[str] = field(default_factory=set)
    experts: Mapping[str, ExpertSlice] = field(default_factory=dict)
    """Expert-parallel tensors (`flashcp.models.expert_parallel.expert_tensors`; empty at
    ep = 1): their rows on this rank, of the full tensor."""

    def expert_names(self) -> set[str]:
        """Trainable expert-parallel parameter names (empty without expert parallelism)."""
        return {n for n, _ in self.params if n in self.experts}


class DistributedOptimizer(Protocol):
    """The optimizer interface the trainer drives each step (see the module docstring)."""

    def local_squares(self) -> float: ...
    def reduce_grads(self) -> None: ...
    def grad_norm(self) -> float: ...
    def step(self) -> None: ...
    def clear_grad(self) -> None: ...
    def full_grads(self) -> dict[str, np.ndarray]: ...
    def describe(self) -> str: ...


def build_distributed_optimizer(setup: OptimizerSetup) -> ParamOptimizer | MasterOptimizer:
    """`ParamOptimizer` for float32 parameters without sharding, else `MasterOptimizer`."""
    low = low_precision_dtype([p for _, p in setup.params])
    if low is None and not setup.shard:
        return ParamOptimizer(setup)
    return MasterOptimizer(setup, low_precision=low)


# -- float32 parameters, unsharded: Paddle's AdamW on the parameters ---------------------------


class ParamOptimizer:
    """Paddle's AdamW on the (float32) parameters; the classic, default path."""

    shards = 1

    def __init__(self, setup: OptimizerSetup) -> None:
        self.setup = setup
        self.tensors = [p for _, p in setup.params]
        self.experts = setup.expert_names()
        self.dense = [p for n, p in setup.params if n not in self.experts]
        self.expert_tensors = [p for n, p in setup.params if n in self.experts]
        self.inner = build_optimizer(
            setup.model, setup.train, setup.scheduler, clip=self._pipeline_clip()
        )

    def _pipeline_clip(self) -> Any:
        """Whole-model gradient clipping for pp > 1 or expert parallelism (None: Paddle's own
        clip, one stage holding every parameter whole)."""
        s = self.setup
        if (int(s.groups.pp.nranks) == 1 and not self.experts) or s.train.grad_clip <= 0:
            return None
        from flashcp.optim.clip import PipelineGlobalNormClip

        return PipelineGlobalNormClip(
            s.train.grad_clip,
            global_names=s.global_names,
            names=s.params,
            group=s.groups.pp,
            skip=sorted(s.shared),
            experts=sorted(self.experts),
            ep_group=s.groups.ep,
        )

    def local_squares(self) -> float:
        """Sum of squares of this rank's own (unreduced) gradients; NaN/Inf propagate."""
        return squared_norm(self.tensors)

    def reduce_grads(self) -> None:
        g, bucket = self.setup.groups, self.setup.bucket_bytes
        if not self.experts:
            sync_grads(self.tensors, [g.cp, g.dp], bucket_bytes=bucket)
            return
        sync_grads(self.dense, [g.cp, g.dp], bucket_bytes=bucket)
        if int(g.cp.nranks) * int(g.dp.nranks) > 1:  # as the dp × cp sum would: zeros, stepped
            for p in self.expert_tensors:
                if p.grad is None:
                    p.grad = paddle.zeros_like(p)
        sync_grads(self.expert_tensors, [g.edp], bucket_bytes=bucket)

    def grad_norm(self) -> float:
        """The global gradient norm (after the cp/dp sums), over every pipeline stage (and
        every ep rank's experts)."""
        s = self.setup
        own = [p for n, p in s.params if n not in s.shared and n not in self.experts]
        local = squared_norm(own)
        if self.experts:
            local += float(all_reduce_values([squared_norm(self.expert_tensors)], [s.groups.ep])[0])
        return math.sqrt(float(all_reduce_values([local], [s.groups.pp])[0]))

    def step(self) -> None:
        self.inner.step()

    def clear_grad(self) -> None:
        self.inner.clear_grad()

    def full_grads(self) -> dict[str, np.ndarray]:
        return {n: p.grad.numpy() for n, p in self.setup.params if p.grad is not None}

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
        totals: Mapping[str, int] | None = None,
    ) -> None:
        self.layout = layout
        self.train = train
        self.segments: list[Segment] = layout.segments()
        self.params = params
        self.offsets = dict(offsets or {})
        """Where a parameter's elements start in the full tensor's (expert rows: the first
        expert held × elements per expert); saved segments use those coordinates."""
        self.totals = dict(totals or {})
        """Elements of the full tensor, for parameters holding only part of it."""
        self.masters: list[paddle.Tensor] = []
        decay: set[str] = set()
        for seg in self.segments:
            p = params[seg.name]
            m = EagerParamBase.from_tensor(_flat_slice(p, seg.start, seg.length))
            if len(p.shape) >= 2:
                decay.add(m.name)
            self.masters.append(m)
        self.decay = decay
        self.by_bucket: dict[int, list[int]] = {}
        for i, seg in enumerate(self.segments):
            self.by_bucket.setdefault(seg.bucket, []).append(i)
        self.inner = paddle.optimizer.AdamW(
            learning_rate=scheduler,
            parameters=self.masters,
            beta1=train.beta1,
            beta2=train.beta2,
            epsilon=train.eps,
            weight_decay=train.weight_decay,
            apply_decay_param_fun=lambda name: name in decay,
        )

    def set_grads(self, b: int, piece: paddle.Tensor | None, present: set[str] | None) -> None:
        """Bucket `b`'s summed gradient slice of this shard (`layout.piece(b)` elements) becomes
        the gradient of its segments; a segment whose parameter is not in `present` (None: all)
        gets none and is not stepped (as Paddle's AdamW skips a parameter without gradient)."""
        for i in self.by_bucket.get(b, []):
            seg = self.segments[i]
            if piece is None or (present is not None and seg.name not in present):
                self.masters[i].grad = None
            else:
                self.masters[i].grad = piece[seg.piece_offset : seg.piece_offset + seg.length]

    def squares(self, skip: set[str]) -> float:
        """Sum of squares (float32 per segment, float64 total) of the segments' gradients."""
        parts = [
            _C_ops.squared_l2_norm(m.grad).reshape([-1])
            for seg, m in zip(self.segments, self.masters, strict=True)
            if m.grad is not None and seg.name not in skip
        ]
        if not parts:
            return 0.0
        return float(np.sum(paddle.concat(parts).numpy().astype(np.float64)))

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


@dataclass
class _Part:
    """The parameters one `MasterShard` covers and the groups its gradients and masters move
    over: the replicated parameters (reduce over cp then dp, gather over dp then cp) or the
    expert-parallel ones (over edp; their squares also summed over ep for the norm)."""

    shard: MasterShard
    reduce: list[Any]
    gather: list[Any]
    norm: list[Any]
    """Groups the shard's squared gradient norm is summed over (before pp)."""

    @property
    def layout(self) -> ShardLayout:
        return self.shard.layout


class MasterOptimizer:
    """Float32 master weights (sharded over dp × cp when `setup.shard`); module docstring."""

    def __init__(self, setup: OptimizerSetup, *, low_precision: str | None = None) -> None:
        self.setup = setup
        g = setup.groups
        self.cp, self.dp, self.pp = g.cp, g.dp, g.pp
        cp_size, dp_size = int(g.cp.nranks), int(g.dp.nranks)
        self.sharded = setup.shard
        self.shards = cp_size * dp_size if setup.shard else 1
        index = int(g.cp.rank) * dp_size + int(g.dp.rank) if setup.shard else 0
        self.reducing = cp_size * dp_size > 1
        """Whether gradients are summed over other ranks (else a missing one stays missing)."""
        self.low_precision = low_precision
        self.hooks = None
        if low_precision is not None:
            self.hooks = attach_main_grad(setup.model, low_precision)
        self.params = dict(setup.params)
        experts = setup.expert_names()
        bucket = max(1, setup.bucket_bytes // 4)

        def shard_of(names: list[str], shards: int, at: int, **kw: Any) -> MasterShard:
            layout = shard_layout([(n, _numel(self.params[n])) for n in names], shards, at, bucket)
            return MasterShard(layout, self.params, setup.train, setup.scheduler, **kw)

        dense = [n for n, _ in setup.params if n not in experts]
        self.shard = shard_of(dense, self.shards, index)
        self.layout = self.shard.layout
        """The replicated parameters' shard and layout (all parameters without ep)."""
        norm = [self.cp, self.dp] if self.sharded else []
        self.parts = [_Part(self.shard, [self.cp, self.dp], [self.dp, self.cp], norm)]
        self.ep, self.edp = g.ep, g.edp
        if experts:
            held = [n for n, _ in setup.params if n in experts]
            rows = {n: _numel(self.params[n]) // setup.experts[n].count for n in held}
            shard = shard_of(
                held,
                int(g.edp.nranks) if self.sharded else 1,
                int(g.edp.rank) if self.sharded else 0,
                offsets={n: setup.experts[n].first * rows[n] for n in held},
                totals={n: setup.experts[n].total * rows[n] for n in held},
            )
            norm = ([self.edp] if self.sharded else []) + [self.ep]
            self.parts.append(_Part(shard, [self.edp], [self.edp], norm))
        self._norm: float | None = None

    # -- gradients --------------------------------------------------------------------------

    def local_squares(self) -> float:
        """Sum of squares of this rank's own (unreduced) float32 gradients; NaN/Inf propagate."""
        parts = []
        for _, p in self.setup.params:
            g = grad_of(p)
            if g is not None:
                parts.append(paddle.sum(paddle.square(g.astype("float32"))))
        if not parts:
            return 0.0
        return float(np.sum(paddle.stack(parts).numpy().astype(np.float64)))

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
        released bucket by bucket."""
        present = None
        if not self.reducing:
            present = {n for n, p in self.setup.params if grad_of(p) is not None}
        for part in self.parts:
            for b, bucket in enumerate(part.layout.buckets):
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
                part.shard.set_grads(b, flat, present)
        self._norm = None

    @staticmethod
    def _release(p: paddle.Tensor) -> None:
        if hasattr(p, "main_grad"):
            p.main_grad = None
        if p.grad is not None:
            p.clear_gradient(False)

    def grad_norm(self) -> float:
        """The global gradient norm: this shard's squares summed over its ranks and stages (the
        expert part's also over the ep ranks)."""
        if self._norm is None:
            shared = self.setup.shared
            if len(self.parts) == 1:
                local = self.shard.squares(shared)
                groups = [self.cp, self.dp, self.pp] if self.sharded else [self.pp]
                self._norm = math.sqrt(float(all_reduce_values([local], groups)[0]))
            else:
                total = sum(
                    float(all_reduce_values([part.shard.squares(shared)], part.norm)[0])
                    for part in self.parts
                )
                self._norm = math.sqrt(float(all_reduce_values([total], [self.pp])[0]))
        return self._norm

    # -- update -----------------------------------------------------------------------------

    @paddle.no_grad()
    def step(self) -> None:
        """Clip (global norm), AdamW on the master shard, write the parameters back."""
        clip = self.setup.train.grad_clip
        if clip > 0:
            norm = paddle.full([1], self.grad_norm(), dtype="float32")
            limit = paddle.full([1], clip, dtype="float32")
            scale = paddle.divide(limit, paddle.maximum(norm, limit))
            for part in self.parts:
                part.shard.scale_grads(scale)
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
        for _, p in self.setup.params:
            self._release(p)
        for part in self.parts:
            part.shard.clear_grads()
        self._norm = None

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

    def describe(self) -> str:
        what = "float32 master weights" + (
            f" (parameters stored in {self.low_precision}, float32 main_grad)"
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
        return (
            f"AdamW on {what}, ZeRO-1 sharded over dp × cp = {self.shards} ranks "
            f"({self.layout.owned} of the stage's elements on this rank){experts}"
        )
