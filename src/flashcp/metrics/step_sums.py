"""A step's small statistics, summed over the step groups in ONE all-reduce.

The trainer packs the step's loss, per-rank flags and peaks, the recipe's statistics and the
routers' expert loads as named blocks of one float64 vector and sums it over the step groups
(cp, dp, pp) at once (`flashcp.optim.grads.all_reduce_values`). A per-rank block holds
`world` zeros with this rank's value at its own index, so after the sum it holds every rank's
value (non-finite flags by rank, memory peaks by rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from flashcp.optim.grads import all_reduce_values


class StepSums:
    """Named blocks of one vector, in the order they are added (`rank` of `world` ranks)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = int(rank), int(world)
        self.blocks: dict[str, np.ndarray] = {}

    def add(self, name: str, values: Sequence[float] | np.ndarray) -> None:
        """A block summed over the ranks."""
        self.blocks[name] = np.asarray(values, dtype=np.float64).reshape(-1)

    def per_rank(self, name: str, value: float) -> None:
        """A block of one value per rank: this rank's `value` at its own index."""
        block = np.zeros(self.world, dtype=np.float64)
        block[self.rank] = value
        self.blocks[name] = block

    def all_reduce(self, groups: Sequence[Any]) -> dict[str, np.ndarray]:
        """Every block summed over `groups` (collective), by name."""
        sizes = [len(b) for b in self.blocks.values()]
        flat = np.concatenate(list(self.blocks.values())) if sizes else np.zeros(0)
        reduced = all_reduce_values(flat, groups)
        out, at = {}, 0
        for name, size in zip(self.blocks, sizes, strict=True):
            out[name], at = reduced[at : at + size], at + size
        return out
