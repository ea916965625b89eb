"""The default optimizer (float32 parameters, `parallel.shard_optimizer: false`): Paddle's
AdamW on the parameters themselves, gradients summed by the bucketed all-reduce over cp, then
dp (expert-parallel ones over edp; `flashcp.optim.grads.sync_grads`). The overview of every
layout is `flashcp.optim.optimizer`'s."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import paddle

from flashcp.config.schema import TrainConfig
from flashcp.distributed import ParallelGroups
from flashcp.optim.adamw import (
    OptimizerSource,
    StatePiece,
    adamw_state,
    build_adamw,
    decay_names,
    load_adamw_state,
)
from flashcp.optim.clip import GlobalNorm, NormOnce
from flashcp.optim.grads import BUCKET_BYTES, squared_norm, sync_grads
from flashcp.optim.trainable import Trainable


class ParamOptimizer(NormOnce):
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
            if g is not None:  # in place, as Paddle's clip scales a dense gradient; float32
                g.multiply_(factor)  # like the factor (low-precision ones: MasterOptimizer)

    def step(self) -> None:
        """Clip by the global norm, then Paddle's AdamW."""
        self._clip()
        self.inner.step()

    def clear_grad(self) -> None:
        """Release the gradients rather than zero them: the next backward writes fresh ones
        instead of adding into zeros (no memset, no read of the zeros; ~0.15 s of a CPU MoE
        step, `scripts/bench/moe_step.py --compare zeroed_grads`). A parameter no target reaches
        still gets zeros before the step (`sync_grads`' `fill_missing_grads`)."""
        self.inner.clear_grad(set_to_zero=False)
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
