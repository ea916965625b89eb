"""Which launch of a job this process belongs to: what `flashcp train` tells every rank it
starts, and again after each automatic restart (`flashcp.launch.restart`).

`flashcp train` sets `FLASHCP_ATTEMPT` (0 for its first launch, k after k restarts),
`FLASHCP_STARTED_AT` (the wall-clock time, s since the epoch, at which `flashcp train` started)
and `FLASHCP_LAUNCHED_AT` (when this launch began: for attempt 0 the start, so its checks count
as start-up). Ranks started by `paddle.distributed.launch` directly have none: attempt 0,
started and launched when this module was first imported. A relaunched rank continues the
run it belongs to (the run directory is its own, `flashcp.rundir`); faults injected for tests
fire in one attempt only (`flashcp.faults`); goodput counts the time a restart cost
(`flashcp.metrics.goodput`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV_ATTEMPT = "FLASHCP_ATTEMPT"
ENV_STARTED_AT = "FLASHCP_STARTED_AT"
ENV_LAUNCHED_AT = "FLASHCP_LAUNCHED_AT"

_IMPORTED_AT = time.time()


@dataclass(frozen=True)
class Attempt:
    """This process's launch: `index` (0: the first of its `flashcp train`), when its
    `flashcp train` started and when this launch began."""

    index: int = 0
    started_at: float = _IMPORTED_AT
    launched_at: float = _IMPORTED_AT

    @property
    def relaunch(self) -> bool:
        """Started again by `flashcp train` after a failure of the same run."""
        return self.index > 0

    def env(self) -> dict[str, str]:
        """The variables that tell a launched process this attempt."""
        return {ENV_ATTEMPT: str(self.index), ENV_STARTED_AT: repr(self.started_at),
                ENV_LAUNCHED_AT: repr(self.launched_at)}  # fmt: skip


def current(environ: dict[str, str] | None = None) -> Attempt:
    """This process's attempt, from the `FLASHCP_ATTEMPT` / `_STARTED_AT` / `_LAUNCHED_AT`
    variables (a value that does not parse counts as unset: these come from `flashcp train`,
    never from a user)."""
    env = os.environ if environ is None else environ
    try:
        index = max(0, int(env.get(ENV_ATTEMPT, "0")))
    except ValueError:
        index = 0
    started, launched = (_seconds(env.get(key)) for key in (ENV_STARTED_AT, ENV_LAUNCHED_AT))
    return Attempt(index, started, launched)


def _seconds(raw: str | None) -> float:
    try:
        return float(raw) if raw else _IMPORTED_AT
    except ValueError:
        return _IMPORTED_AT
