"""Slow ranks named: a rank whose compute time stays above its peers' is a failing device, link
or host on a real cluster.

Each step every rank's busy time (its forward and backward) less the time it spent inside
collectives and send/recv (`flashcp.distributed.waited_seconds`: waiting for its peers, or
moving bytes) arrives in the step's exchange (`flashcp.metrics.step_sums`). A synchronous job
runs at its slowest rank's pace, so busy times alone look alike: the others spend the
difference waiting in collectives, which this takes out. `StragglerWatch` divides each rank's
compute time by the median of its pipeline stage's ranks (stages do different work) and names
a rank whose ratio stays above `run.straggler_ratio` for `run.straggler_window` steps in a row
(one slow step is noise, not a straggler); it is cleared once a window passes without.

On GPU a collective returns once queued (`flashcp.distributed.collectives`): the host sees the
device's waits only where it synchronises, so a slow GPU shows less here than a slow host.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flashcp.config import Config
from flashcp.distributed import ParallelGroups


@dataclass(frozen=True)
class Straggler:
    """A named slow rank: its compute time over its stage's median (median over the window)."""

    rank: int
    ratio: float

    def metrics(self) -> dict[str, float]:
        """`straggler/rank` and `straggler/ratio`, as a metrics record carries them."""
        return {"straggler/rank": float(self.rank), "straggler/ratio": self.ratio}


def stage_ratios(compute: np.ndarray, stages: Sequence[int]) -> np.ndarray:
    """Each rank's compute time over the median of its stage's ranks (1 for a rank alone in
    its stage, or a stage whose median is 0)."""
    compute = np.asarray(compute, dtype=np.float64)
    stages_arr = np.asarray(stages)
    out = np.ones_like(compute)
    for stage in np.unique(stages_arr):
        members = np.flatnonzero(stages_arr == stage)
        median = float(np.median(compute[members]))
        if len(members) > 1 and median > 0:
            out[members] = compute[members] / median
    return out


class StragglerWatch:
    """Names the rank whose `stage_ratios` stay above `ratio` for `window` steps in a row.

    `stages[r]` is rank r's pipeline stage. `observe` takes one step's compute times and
    returns the rank named now (None) and, when that changed, the line to log."""

    def __init__(self, stages: Sequence[int], *, ratio: float, window: int) -> None:
        self.stages = list(stages)
        self.ratio = float(ratio)
        self.window = int(window)
        self.history: deque[np.ndarray] = deque(maxlen=max(self.window, 1))
        self.named: Straggler | None = None

    @classmethod
    def of(cls, cfg: Config, groups: ParallelGroups) -> StragglerWatch:
        """The watch of a run: every rank's pipeline stage from `groups`, the ratio and window
        from `run.straggler_ratio` / `run.straggler_window`."""
        world = int(groups.world.nranks)
        stages = [groups.dims.coords(r)["pp"] for r in range(world)]
        return cls(stages, ratio=cfg.run.straggler_ratio, window=cfg.run.straggler_window)

    def observe(self, compute: Sequence[float] | np.ndarray) -> tuple[Straggler | None, str | None]:
        """Add one step; returns (the straggler named now, the line to log if that changed)."""
        if self.window <= 0 or len(self.stages) < 2:
            return None, None
        self.history.append(stage_ratios(np.asarray(compute), self.stages))
        if len(self.history) < self.window:
            return self.named, None
        window = np.stack(self.history)
        lowest = window.min(axis=0)  # above the threshold at every step of the window
        slow = np.flatnonzero(lowest > self.ratio)
        before = self.named
        if slow.size:
            rank = int(slow[np.argmax(lowest[slow])])
            self.named = Straggler(rank, float(np.median(window[:, rank])))
        elif before is not None and (window[:, before.rank] <= self.ratio).all():
            self.named = None
        elif before is not None:  # still slow on some steps: keep it, with the new ratio
            self.named = Straggler(before.rank, float(np.median(window[:, before.rank])))
        return self.named, self._change(before)

    def _change(self, before: Straggler | None) -> str | None:
        now = self.named
        if now is not None and (before is None or before.rank != now.rank):
            return (
                f"straggler: rank {now.rank} computed {now.ratio:.2f}x the median of its "
                f"pipeline stage's ranks over the last {self.window} steps (above "
                f"{self.ratio:g}x at every one; busy time less its waits in collectives): a slow "
                "device, link or host?"
            )
        if now is None and before is not None:
            return (
                f"straggler: rank {before.rank} is back within {self.ratio:g}x the median of "
                f"its stage for {self.window} steps"
            )
        return None
