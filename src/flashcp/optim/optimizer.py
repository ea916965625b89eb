"""The optimizer step of every layout: AdamW on the parameters, or on float32 master weights,
optionally sharded over the ranks that hold the same parameters (ZeRO-1), gradients too
(ZeRO-2).

`build_distributed_optimizer(model, train, scheduler, groups)` picks one of two
implementations of one interface (`DistributedOptimizer`: `local_squares`, `reduce_grads`,
`grad_norm`, `step`, `clear_grad`, `full_grads`, `state_pieces`, `load_state`, `describe`).
What they need beyond the model, the config and the groups is derived once, from those
(`flashcp.optim.trainable.Trainable`): the trainable parameters, the expert-parallel ones
(ep > 1: `experts`, name → `RowSlice`, given by the caller, which knows the model), the whole
model's parameter order (gathered over the pipeline stages) and the tied copy another stage
counts.

* `ParamOptimizer` (`flashcp.optim.param_optimizer`) - float32 parameters and
  `parallel.shard_optimizer: false` (the default): Paddle's AdamW on the parameters
  themselves, gradients summed by the bucketed all-reduce over cp, then dp
  (`flashcp.optim.grads.sync_grads`).
* `MasterOptimizer` (`flashcp.optim.master_optimizer`; each rank's masters a
  `flashcp.optim.master_shard.MasterShard`) - a trainable parameter stored in bfloat16/float16,
  or `parallel.shard_optimizer: true`:

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

Expert parallelism (`parallel.ep` > 1; the caller's `experts` name the expert-parallel tensors
and the rows each holds, the trainer's from `flashcp.models.expert_parallel.expert_tensors`): a
rank holds only its experts' rows, equal on the dp·cp/ep ranks
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

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import paddle

from flashcp.config.schema import TrainConfig
from flashcp.distributed import ParallelGroups
from flashcp.optim.adamw import OptimizerSource, StatePiece
from flashcp.optim.grads import BUCKET_BYTES
from flashcp.optim.master_optimizer import MasterOptimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.optim.trainable import RowSlice, Trainable, low_precision_dtype


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
    experts: Mapping[str, RowSlice] | None = None,
) -> ParamOptimizer | MasterOptimizer:
    """The optimizer of this rank's `model` (its pipeline stage): `ParamOptimizer` for float32
    parameters without sharding, else `MasterOptimizer` (`shard`: ZeRO-1; `shard_gradients`
    too: ZeRO-2). `scheduler`: the LR scheduler (`flashcp.optim.lr.build_scheduler`) or a
    fixed LR. `experts`: the expert-parallel parameters and the rows this rank holds of each
    (required when the ep group has more than one rank). Collective over pp."""
    if shard_gradients and not shard:
        raise ValueError(
            "parallel.shard_gradients: true shards the gradients like the optimizer state, "
            "which needs parallel.shard_optimizer: true"
        )
    held = Trainable.of(model, groups, experts)
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
