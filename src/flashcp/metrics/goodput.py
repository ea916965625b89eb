"""Goodput: the share of a run's wall time spent on steps that count, and where the rest went.

Rank 0 keeps one ledger per run, `goodput.json` in the run directory, rewritten (atomically)
after every step and every checkpoint, so it holds the running totals at any moment and the
run's totals at its end (`complete`). Every metrics record carries the same totals
(`goodput/...`, `restarts`). Times are wall-clock seconds:

* `productive_s`: the steps the run keeps (each step's `step_time_s`; steps redone after a
  restart count once, the last time);
* `wall_s`: the time the job ran — every launch from its start (`flashcp.attempt`) to its last
  step, and the time between a failure and the relaunch; not the time a pre-empted or failed
  run spent waiting to be started again by hand or by a scheduler;
* lost to `checkpoint_s` (`checkpoint/stall_s`: the loop held by saves), `startup_s` (from a
  launch by `flashcp train` or the scheduler to its first step: checks, processes, imports,
  model build, checkpoint load), `restart_s` (after an automatic restart: everything from the
  ledger's last update before the failure to the relaunched first step — detection, stop,
  backoff, relaunch, reload — plus the steps redone since the checkpoint resumed from), and
  `other_s` (the rest: evaluation, logging, gaps between steps).

`goodput` = productive_s / wall_s. The ledger remembers the productive time at each
checkpoint (`saves`), so a resume knows which steps it redoes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashcp.attempt import Attempt
from flashcp.rundir import GOODPUT_FILE, restart_records

KEEP_SAVES = 16
"""Checkpoints whose productive time the ledger remembers (newest first kept)."""


@dataclass
class Totals:
    """The ledger (`goodput.json`, see the module docstring)."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    checkpoint_s: float = 0.0
    startup_s: float = 0.0
    restart_s: float = 0.0
    step: int = 0
    """The last step done."""
    updated: float = 0.0
    """Wall clock (s since the epoch) of the last update."""
    restarts: int = 0
    complete: bool = False
    """The run reached train.steps."""
    saves: dict[str, float] = field(default_factory=dict)
    """Checkpoint step → `productive_s` when it was saved."""

    @property
    def other_s(self) -> float:
        lost = self.checkpoint_s + self.startup_s + self.restart_s
        return max(0.0, self.wall_s - self.productive_s - lost)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": self.goodput, "other_s": self.other_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Totals:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})

    def productive_at(self, step: int) -> float:
        """`productive_s` when checkpoint `step` was saved (estimated from the mean step when
        the ledger does not remember it)."""
        if str(step) in self.saves:
            return float(self.saves[str(step)])
        return self.productive_s * min(step, self.step) / self.step if self.step else 0.0


def read_goodput(output_dir: str | Path) -> Totals | None:
    """The ledger of the run in `output_dir` (None: none, or unreadable)."""
    try:
        return Totals.from_json(json.loads((Path(output_dir) / GOODPUT_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class Goodput:
    """Rank 0's ledger for this launch (`enabled` False elsewhere: every call does nothing)."""

    def __init__(self, output_dir: str | Path, *, attempt: Attempt, enabled: bool) -> None:
        self.path = Path(output_dir) / GOODPUT_FILE
        self.attempt = attempt
        self.enabled = enabled
        self.totals = Totals()

    def start(self, resumed_step: int | None, now: float | None = None) -> None:
        """Right before this launch's first step: carry on the run's ledger (a resumed run, or
        a relaunch) or start one, charging the time since the launch to start-up or restart."""
        if not self.enabled:
            return
        now = time.time() if now is None else now
        earlier = read_goodput(self.path.parent)
        carry_on = earlier is not None and (resumed_step is not None or self.attempt.relaunch)
        t = earlier if carry_on and earlier is not None else Totals()
        if carry_on:
            kept = t.productive_at(resumed_step) if resumed_step is not None else 0.0
            redone = max(0.0, t.productive_s - kept)
            t.productive_s = kept
            t.restart_s += redone
            t.saves = {k: v for k, v in t.saves.items() if int(k) <= (resumed_step or 0)}
        if carry_on and self.attempt.relaunch:
            down = max(0.0, now - max(t.updated, self.attempt.started_at))
            t.restart_s += down
            t.wall_s += down
        else:
            gap = max(0.0, now - self.attempt.launched_at)
            t.startup_s += gap
            t.wall_s += gap
        t.step = resumed_step or 0
        t.complete = False
        t.restarts = len(restart_records(self.path.parent))
        t.updated = now
        self.totals = t
        self._write()

    def step(self, step: int, step_time_s: float, now: float | None = None) -> None:
        """Step `step` is done; it took `step_time_s` of the time since the last update."""
        if not self.enabled:
            return
        t = self._advance(now)
        t.productive_s += step_time_s
        t.step = step
        self._write()

    def checkpoint(self, step: int | None, stall_s: float, now: float | None = None) -> None:
        """The checkpointer held the loop for `stall_s` s, up to now: a save of checkpoint
        `step`, or (None) the commit of an asynchronous save in flight."""
        if not self.enabled:
            return
        t = self._advance(now)
        t.checkpoint_s += stall_s
        if step is not None:
            t.saves[str(step)] = t.productive_s
            for old in sorted(t.saves, key=int)[:-KEEP_SAVES]:
                del t.saves[old]
        self._write()

    def finish(self, complete: bool) -> Path | None:
        """The run ends (`complete`: it reached train.steps); returns the ledger's path."""
        if not self.enabled:
            return None
        self.totals.complete = complete
        self._write()
        return self.path

    def metrics(self) -> dict[str, float]:
        """The running totals a metrics record carries."""
        if not self.enabled:
            return {}
        t = self.totals
        return {
            "goodput/ratio": t.goodput,
            "goodput/productive_s": t.productive_s,
            "goodput/wall_s": t.wall_s,
            "goodput/restart_s": t.restart_s,
            "goodput/checkpoint_s": t.checkpoint_s,
            "goodput/startup_s": t.startup_s,
            "restarts": float(t.restarts),
        }

    def _advance(self, now: float | None) -> Totals:
        t = self.totals
        now = time.time() if now is None else now
        t.wall_s += max(0.0, now - t.updated)
        t.updated = now
        return t

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.totals.to_json(), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)
