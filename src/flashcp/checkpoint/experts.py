"""Checkpoint arrays of expert-parallel models: whole on disk, sliced in memory.

Under expert parallelism (`parallel.ep` > 1) a rank holds rows `[first, first + count)` of
every stacked expert tensor (`flashcp.models.expert_parallel.expert_tensors`: the experts'
weights, their LoRA adapters, and so their AdamW moments and gradients). Checkpoints, adapter
exports and gradient dumps keep the layout-independent form — the FULL `[E, ...]` tensors
under the full model's names — so they load into any ep (or into `flashcp export`, which builds
stages without ep):

* writing (`ExpertArrays.collect`): the ranks of the stage writer's ep group (ep ranks 0..ep-1
  of the first ep group, the stage's edp rank 0) send their rows to the stage writer, one
  tensor at a time (`flashcp.distributed.gather_rows`, on the ep group's links), which
  concatenates them; no other rank holds more than its own share;
* reading (`ExpertArrays.slice`): every rank takes its rows of the full model arrays.

Optimizer state is read without slicing: the optimizers read their rows of the full tensor by
element range (`flashcp.optim.adamw.OptimizerSource`), and optimizer shards (float32 masters)
are in the full tensors' element coordinates already (`flashcp.checkpoint.optimizer_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import paddle

from flashcp.distributed import ParallelGroups, gather_rows
from flashcp.models.expert_parallel import ExpertSlice, expert_tensors

KeyFn = Callable[[str], "str | None"]
"""Array key → the parameter it belongs to (None: not an expert-parallel tensor's rows)."""


def model_key(key: str) -> str:
    """Model and adapter arrays are keyed by the parameter's own name (optimizer arrays:
    `flashcp.checkpoint.optimizer_state.optimizer_key`)."""
    return key


class ExpertArrays:
    """The expert-parallel tensors of one rank's module and how to gather / slice their rows."""

    def __init__(self, module: paddle.nn.Layer, groups: ParallelGroups) -> None:
        self.groups = groups
        self.ep = int(groups.ep.nranks)
        self.slices: dict[str, ExpertSlice] = expert_tensors(module) if self.ep > 1 else {}
        self.exchange = groups.ep_exchange()

    @property
    def active(self) -> bool:
        return self.ep > 1

    @property
    def collector(self) -> bool:
        """Whether this rank takes part in `collect` (the stage writer's ep group)."""
        if not self.active:
            return int(self.groups.cp.rank) == 0 and int(self.groups.dp.rank) == 0
        return int(self.groups.edp.rank) == 0

    def expert(self, key: str, key_fn: KeyFn) -> ExpertSlice | None:
        name = key_fn(key)
        return None if name is None else self.slices.get(name)

    def collect(
        self, arrays_fn: Callable[[], Mapping[str, np.ndarray]], key_fn: KeyFn = model_key
    ) -> dict[str, np.ndarray] | None:
        """`arrays_fn()`'s arrays with every expert tensor whole, on the stage writer (None
        elsewhere). Collective over the stage writer's ep group: every rank may call it, only
        those ranks compute `arrays_fn()` and exchange rows."""
        if not self.collector:
            return None
        arrays = dict(arrays_fn())
        if not self.active:
            return arrays
        out: dict[str, np.ndarray] = {}
        for key in sorted(arrays):  # the same keys, in the same order, on every ep rank
            piece = self.expert(key, key_fn)
            value = arrays[key]
            if piece is None:
                out[key] = value
                continue
            self._check_rows(key, value, piece.count)
            full = gather_rows(paddle.to_tensor(np.ascontiguousarray(value)), self.exchange)
            if full is not None:
                out[key] = full.numpy()
        return out if int(self.groups.ep.rank) == 0 else None

    def slice(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Model (or adapter) `arrays` with each whole expert tensor cut to this rank's rows
        (others unchanged)."""
        if not self.slices:
            return dict(arrays)
        out = {}
        for key, value in arrays.items():
            piece = self.slices.get(key)
            if piece is not None:
                self._check_rows(key, value, piece.total)
                value = value[piece.first : piece.first + piece.count]
            out[key] = value
        return out

    @staticmethod
    def _check_rows(key: str, value: Any, rows: int) -> None:
        shape = list(np.shape(value))
        if not shape or shape[0] != rows:
            raise ValueError(
                f"{key} has shape {shape}, expected {rows} experts on its first axis (a "
                "checkpoint of another model.num_experts?)"
            )
