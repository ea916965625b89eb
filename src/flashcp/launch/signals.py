"""What `flashcp train` does with signals while its job runs.

SIGTERM or `run.preempt_signal` (`flashcp.launch.preempt.preempt_signals`) pre-empts: the
signal is passed on to every rank of this node, which finish their step, save and exit 75; the
job is stopped if that takes longer than `run.preempt_grace_s`, and a second signal stops it
at once. Ctrl-C (SIGINT) does the same (the ranks get SIGTERM) and exits 130; Ctrl-C again
stops the job at once. `Signals` notes them (the handler only sets values) and says them: the
console line when they reach the ranks, what the first one asked, the exit code after a stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any


class Signals:
    """What `flashcp train` does with signals while its job runs (module docstring): the first
    pre-emption signal or Ctrl-C is passed on to the ranks (`preempting`; Ctrl-C as SIGTERM,
    which every rank takes as a request to save and stop), a second one stops at once
    (`stop`)."""

    def __init__(self, preempt: tuple[signal.Signals, ...]) -> None:
        self.preempt = preempt
        self.preempting: int | None = None
        self.preempted_at = 0.0
        self.stop: int | None = None
        self.passed_on: set[int] = set()
        """The ranks (pids) the pre-emption signal was passed on to."""
        self._previous: dict[int, Any] = {}

    def install(self) -> Signals:
        for sig in {signal.SIGINT, *self.preempt}:
            self._previous[int(sig)] = signal.signal(sig, self._on)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on(self, signum: int, _frame: object) -> None:
        if self.preempting is not None:
            self.stop = self.stop or signum
        else:
            self.preempting, self.preempted_at = signum, time.monotonic()

    @property
    def ctrl_c(self) -> bool:
        """The job is stopping on Ctrl-C (not on a pre-emption signal)."""
        return self.preempting == signal.SIGINT

    @property
    def passed(self) -> int:
        """The signal the ranks get: the pre-emption signal itself, SIGTERM for Ctrl-C."""
        return int(signal.SIGTERM if self.ctrl_c else (self.preempting or signal.SIGTERM))

    def pass_on(self, ranks: list[int]) -> list[int]:
        """Send the pre-emption signal to those of `ranks` (pids) that have not had it yet (a
        rank started after the signal came gets it too); returns them."""
        if self.preempting is None:
            return []
        fresh = [pid for pid in ranks if pid not in self.passed_on]
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, self.passed)
            self.passed_on.add(pid)
        return fresh

    def name(self, signum: int | None = None) -> str:
        """`Ctrl-C (SIGINT)`, `SIGTERM`, ...: the signal (default: the first) for a person."""
        sig = signal.Signals(signum or self.preempting or signal.SIGTERM)
        return "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name

    @property
    def code(self) -> int:
        """The exit code after a stop: 128 + the signal."""
        return 128 + int(self.stop or self.preempting or signal.SIGTERM)

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds`; False as soon as a signal came (`stop` or `preempting`)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop is not None or self.preempting is not None:
                return False
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        return self.stop is None and self.preempting is None

    def asked(self) -> str:
        """`stopped by Ctrl-C (SIGINT)` or `pre-empted (SIGTERM)`: what the first signal asked."""
        if self.ctrl_c:
            return "stopped by Ctrl-C (SIGINT)"
        return f"pre-empted ({self.name()})"

    def notice(self, ranks: int, grace_s: float) -> str:
        """The line that says a pre-emption (or Ctrl-C) reached `ranks` ranks (`grace_s`:
        `run.preempt_grace_s`)."""
        grace = f"run.preempt_grace_s {grace_s:g} s"
        if self.ctrl_c:
            return (f"flashcp: Ctrl-C: passed on to {ranks} rank(s) as SIGTERM; they finish the "
                    f"step, save and stop ({grace}; Ctrl-C again stops them at once)")  # fmt: skip
        return (f"flashcp: pre-emption ({self.name()}): passed on to {ranks} rank(s); they "
                f"finish the step, save and stop ({grace})")  # fmt: skip
