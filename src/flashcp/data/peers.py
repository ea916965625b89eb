"""The processes that build a dataset's index together (`flashcp.data.index`).

The data layer does not talk to the distributed runtime itself (layers import only downward):
a recipe hands it `Peers` — this process's rank among them, their number, and an all-gather of
small picklable objects in rank order (with a timeout, `flashcp.distributed.all_gather_object`).
Alone (`Peers()`), a process does all the work itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _alone(obj: Any) -> list[Any]:
    return [obj]


@dataclass(frozen=True)
class Peers:
    """`rank` of `size` processes; `gather(obj)` returns every process's `obj` in rank order
    (every process must call it, the same number of times)."""

    rank: int = 0
    size: int = 1
    gather: Callable[[Any], list[Any]] = field(default=_alone)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.size})")

    def share(self, n: int) -> tuple[int, int]:
        """This process's contiguous share `[lo, hi)` of `n` items: `[n·rank // size,
        n·(rank + 1) // size)` (shares differ by at most one item and cover 0..n-1)."""
        return n * self.rank // self.size, n * (self.rank + 1) // self.size
