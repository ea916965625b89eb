"""The optimizer step of every layout: AdamW on the parameters, or on float32 master weights,
optionally sharded over the ranks that hold the same parameters (ZeRO-1).

`build_distributed_optimizer(setup)` picks one of two implementations of one interface
(`local_squares`, `reduce_grads`, `grad_norm`, `step`, `clear_grad`, `full_grads`,
`state_arrays`, `load_state`, `describe`):

* `ParamOptimizer` - float32 parameters and `parallel.shard_optimizer: false` (the default):
  Paddle's AdamW on the parameters themselves, gradients summed by the bucketed all-reduce over
  cp, then dp (`flashcp.trainer.parallel.sync_grads`), Paddle's global-norm clip (the whole
  model's norm over pipeline stages: `flashcp.trainer.clip`). Operation for operation the
  trainer's step from before this module.
* `MasterOptimizer` - a trainable parameter stored in bfloat16/float16, or
  `parallel.shard_optimizer: true`:

  1. gradients accumulate over the micro-batches in float32: `param.main_grad`, written by
     fleet's `MixPrecisionLayer` gradient hooks, for a model with low-precision parameters
     (`attach_main_grad`); float32 parameters otherwise keep `.grad`;
  2. per bucket (`flashcp.trainer.zero_layout`) the float32 gradients are flattened and either
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
from flashcp.trainer.optim import build_optimizer
from flashcp.trainer.parallel import all_reduce_values, squared_norm, sync_grads
from flashcp.trainer.state import load_optimizer_arrays, optimizer_arrays
from flashcp.trainer.zero_layout import Segment, ShardLayout, shard_layout
from flashcp.trainer.zero_state import (
    OptimizerSource,
    ShardArrays,
    fresh_betas,
)

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


class DistributedOptimizer(Protocol):
    """The optimizer interface the trainer drives each step (see the module docstring)."""

    def local_squares(self) -> float: ...
    def reduce_grads(self) -> None: ...
    def grad_norm(self) -> float: ...
    def step(self) -> None: ...
    def clear_grad(self) -> None: ...
    def full_grads(self) -> dict[str, np.ndarray]: ...
    def load_state(self, source: OptimizerSource) -> None: ...
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
        self.inner = build_optimizer(
            setup.model, setup.train, setup.scheduler, clip=self._pipeline_clip()
        )

    def _pipeline_clip(self) -> Any:
        """Whole-model gradient clipping for pp > 1 (None: Paddle's own clip, pp = 1)."""
        s = self.setup
        if int(s.groups.pp.nranks) == 1 or s.train.grad_clip <= 0:
            return None
        from flashcp.trainer.clip import PipelineGlobalNormClip

        return PipelineGlobalNormClip(
            s.train.grad_clip,
            global_names=s.global_names,
            names=s.params,
            group=s.groups.pp,
            skip=sorted(s.shared),
        )

    def local_squares(self) -> float:
        """Sum of squares of this rank's own (unreduced) gradients; NaN/Inf propagate."""
        return squared_norm(self.tensors)

    def reduce_grads(self) -> None:
        g = self.setup.groups
        sync_grads(self.tensors, [g.cp, g.dp], bucket_bytes=self.setup.bucket_bytes)

    def grad_norm(self) -> float:
        """The global gradient norm (after the cp/dp sums), over every pipeline stage."""
        own = [p for n, p in self.setup.params if n not in self.setup.shared]
        pp = self.setup.groups.pp
        return math.sqrt(float(all_reduce_values([squared_norm(own)], [pp])[0]))

    def step(self) -> None:
        self.inner.step()

    def clear_grad(self) -> None:
        self.inner.clear_grad()

    def full_grads(self) -> dict[str, np.ndarray]:
        return {n: p.grad.numpy() for n, p in self.setup.params if p.grad is not None}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """AdamW state as `<name>::<accumulator>` arrays (`flashcp.trainer.state`)."""
        return optimizer_arrays(self.inner, self.setup.model)

    def load_state(self, source: OptimizerSource) -> None:
        shapes = {n: list(p.shape) for n, p in self.setup.params}
        load_optimizer_arrays(self.inner, self.setup.model, source.classic(shapes))

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
    ) -> None:
        self.layout = layout
        self.train = train
        self.segments: list[Segment] = layout.segments()
        self.params = params
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

    # -- state ------------------------------------------------------------------------------

    def arrays(self) -> ShardArrays:
        """The shard's state as packed float32 arrays plus its segment map."""
        state = self.inner.state_dict()
        b1, b2 = fresh_betas(self.train.beta1, self.train.beta2)

        def acc(m: paddle.Tensor, key: str, default: np.ndarray) -> np.ndarray:
            value = state.get(f"{m.name}_{key}")
            return value.numpy().reshape([-1]) if value is not None else default

        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)

        zeros = [np.zeros(s.length, np.float32) for s in self.segments]
        return ShardArrays(
            segments=[(s.name, s.start, s.length, s.offset) for s in self.segments],
            numel={n: _numel(p) for n, p in self.params.items()},
            shards=self.layout.shards,
            index=self.layout.index,
            master=cat([m.numpy() for m in self.masters]),
            moment1=cat([acc(m, "moment1_0", z) for m, z in zip(self.masters, zeros, strict=True)]),
            moment2=cat([acc(m, "moment2_0", z) for m, z in zip(self.masters, zeros, strict=True)]),
            beta1_pow=cat([acc(m, "beta1_pow_acc_0", b1) for m in self.masters]),
            beta2_pow=cat([acc(m, "beta2_pow_acc_0", b2) for m in self.masters]),
        )

    def load(self, source: OptimizerSource) -> None:
        """Masters and AdamW state of every segment from `source` (any saved layout). Without a
        saved master (an unsharded float32 checkpoint) the master is the parameter's value; a
        parameter without any saved state starts fresh, as Paddle's AdamW would."""
        state: dict[str, paddle.Tensor] = {}
        for seg, m in zip(self.segments, self.masters, strict=True):
            master = source.read(seg.name, "master", seg.start, seg.length)
            if master is None:
                master = _flat_slice(self.params[seg.name], seg.start, seg.length).numpy()
            m.set_value(master.astype(np.float32, copy=False))
            m1 = source.read(seg.name, "moment1", seg.start, seg.length)
            m2 = source.read(seg.name, "moment2", seg.start, seg.length)
            betas = source.beta_pows(seg.name)
            if m1 is None and m2 is None and betas is None:
                continue
            if m1 is None or m2 is None or betas is None:
                raise ValueError(
                    f"the checkpoint's optimizer state of {seg.name!r} is incomplete (moments or "
                    "beta powers missing): was it written by another flashcp version?"
                )
            state[f"{m.name}_moment1_0"] = paddle.to_tensor(m1)
            state[f"{m.name}_moment2_0"] = paddle.to_tensor(m2)
            state[f"{m.name}_beta1_pow_acc_0"] = paddle.to_tensor(betas[0].reshape([1]))
            state[f"{m.name}_beta2_pow_acc_0"] = paddle.to_tensor(betas[1].reshape([1]))
        if state:
            self.inner.set_state_dict(state)


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
        self.layout = shard_layout(
            [(n, _numel(p)) for n, p in setup.params],
            self.shards,
            index,
            max(1, setup.bucket_bytes // 4),
        )
        self.shard = MasterShard(self.layout, self.params, setup.train, setup.scheduler)
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
    def _flat(self, b: int) -> paddle.Tensor:
        bucket = self.layout.buckets[b]
        parts = []
        for name, size in zip(bucket.names, bucket.sizes, strict=True):
            g = grad_of(self.params[name])
            parts.append(
                paddle.zeros([size], "float32") if g is None else g.astype("float32").reshape([-1])
            )
        pad = bucket.padded(self.shards) - bucket.numel
        if pad:
            parts.append(paddle.zeros([pad], "float32"))
        return paddle.concat(parts) if len(parts) > 1 else parts[0].clone()

    @paddle.no_grad()
    def reduce_grads(self) -> None:
        """Sum the gradients over cp, then dp: all of them (unsharded), or each rank's shard
        (reduce-scatter). The parameters' own gradients are released bucket by bucket."""
        present = None
        if not self.reducing:
            present = {n for n, p in self.setup.params if grad_of(p) is not None}
        for b, bucket in enumerate(self.layout.buckets):
            flat = self._flat(b)
            for name in bucket.names:
                self._release(self.params[name])
            for group in (self.cp, self.dp):
                if int(group.nranks) == 1:
                    continue
                if self.sharded:
                    flat = reduce_scatter(flat, group)
                else:
                    all_reduce_tensor(flat, group, inplace=True)
            self.shard.set_grads(b, flat, present)
        self._norm = None

    @staticmethod
    def _release(p: paddle.Tensor) -> None:
        if hasattr(p, "main_grad"):
            p.main_grad = None
        if p.grad is not None:
            p.clear_gradient(False)

    def grad_norm(self) -> float:
        """The global gradient norm: this shard's squares summed over its ranks and stages."""
        if self._norm is None:
            local = self.shard.squares(self.setup.shared)
            groups = [self.cp, self.dp, self.pp] if self.sharded else [self.pp]
            self._norm = math.sqrt(float(all_reduce_values([local], groups)[0]))
        return self._norm

    # -- update -----------------------------------------------------------------------------

    @paddle.no_grad()
    def step(self) -> None:
        """Clip (global norm), AdamW on the master shard, write the parameters back."""
        clip = self.setup.train.grad_clip
        if clip > 0:
            norm = paddle.full([1], self.grad_norm(), dtype="float32")
            limit = paddle.full([1], clip, dtype="float32")
            self.shard.scale_grads(paddle.divide(limit, paddle.maximum(norm, limit)))
        self.shard.step()
        self._write_back()

    @paddle.no_grad()
    def _write_back(self) -> None:
        for b, bucket in enumerate(self.layout.buckets):
            full = self.shard.piece(b)
            if self.sharded:
                for group in (self.dp, self.cp):
                    full = all_gather_tensor(full, group)
            for name, size, start in zip(bucket.names, bucket.sizes, bucket.starts(), strict=True):
                p = self.params[name]
                value = full[start : start + size].reshape(list(p.shape))
                paddle.assign(value.astype(p.dtype) if dtype_name(p) != "float32" else value, p)

    def clear_grad(self) -> None:
        for _, p in self.setup.params:
            self._release(p)
        self.shard.clear_grads()
        self._norm = None

    def full_grads(self) -> dict[str, np.ndarray]:
        """The summed gradients by name (unsharded only: a shard holds a slice of them)."""
        if self.shards > 1:
            raise ValueError("the full gradients do not exist under parallel.shard_optimizer")
        return {
            seg.name: m.grad.numpy().reshape(self.params[seg.name].shape)
            for seg, m in zip(self.shard.segments, self.shard.masters, strict=True)
            if m.grad is not None
        }

    # -- state ------------------------------------------------------------------------------

    def master_slices(self) -> dict[str, tuple[int, int]]:
        """`[start, stop)` of each flattened parameter this rank holds masters for."""
        return {s.name: (s.start, s.start + s.length) for s in self.shard.segments}

    @paddle.no_grad()
    def set_masters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite the masters of the parameters in `values` (each the float32 elements of
        `master_slices()[name]`), e.g. a checkpoint's own float32 values instead of the
        parameters rounded to their storage dtype."""
        for seg, m in zip(self.shard.segments, self.shard.masters, strict=True):
            if seg.name in values:
                value = np.asarray(values[seg.name], np.float32).reshape(-1)
                if value.size != seg.length:
                    raise ValueError(
                        f"master values of {seg.name!r} have {value.size} elements, this rank "
                        f"holds {seg.length}"
                    )
                m.set_value(value)

    def state_arrays(self) -> ShardArrays:
        return self.shard.arrays()

    def load_state(self, source: OptimizerSource) -> None:
        self.shard.load(source)

    def describe(self) -> str:
        what = "float32 master weights" + (
            f" (parameters stored in {self.low_precision}, float32 main_grad)"
            if self.low_precision
            else ""
        )
        if not self.sharded:
            return f"AdamW on {what}"
        if self.shards == 1:
            return (
                f"AdamW on {what}; parallel.shard_optimizer: 1 shard (dp × cp = 1: nothing to "
                "shard)"
            )
        return (
            f"AdamW on {what}, ZeRO-1 sharded over dp × cp = {self.shards} ranks "
            f"({self.layout.owned} of the stage's elements on this rank)"
        )
