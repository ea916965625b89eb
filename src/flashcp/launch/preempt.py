"""Pre-emption in a rank: SIGTERM or `run.preempt_signal` asks this rank to stop after the step
it is in, with a checkpoint; the process keeps running until then.

A scheduler may signal `flashcp train` (which passes the signal on to every rank,
`flashcp.launch.signals`), one rank, or every rank. The rank only notes it (`StopSignals`): the
trainer exchanges each rank's note with the step's other numbers (one all-reduce,
`flashcp.metrics.step_sums`), so every rank learns at the same step that some rank was asked to
stop, finishes that step, saves, and exits with `EXIT_PREEMPTED` (75). Nothing else in the
rank is interrupted: the handler sets a value and returns (system calls it interrupts are
restarted), and only SIGKILL — from the launcher, `flashcp train` after `run.preempt_grace_s`,
or the scheduler — ends a rank that cannot reach a step boundary in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

from flashcp.launch.outcome import SIGNAL_NOTED

PREEMPT_BASE = (signal.SIGTERM,)
"""Signals that always pre-empt (`run.preempt_signal` adds one)."""


def preempt_signals(second: str | None) -> tuple[signal.Signals, ...]:
    """SIGTERM and the configured second signal (by name, e.g. "SIGUSR1"; None: none)."""
    extra = () if second is None else (signal.Signals[second],)
    return tuple(dict.fromkeys((*PREEMPT_BASE, *extra)))


@dataclass
class Received:
    """The first pre-emption signal this process got, and when (wall clock, s)."""

    signum: int
    at: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignals:
    """Notes the first pre-emption signal this process receives; `()` is 0 until then, then
    the signal's number (what the rank contributes to the step's exchange).

    Python runs a signal handler in the main thread, which may be waiting inside a collective
    for a long time; the signal's arrival is also written to a pipe (`signal.set_wakeup_fd`)
    that a thread reads, so the rank logs it at once (`outcome.SIGNAL_NOTED`): a rank the
    launcher stops, and kills when it does not exit, is told apart from one killed without a
    word."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPT_BASE, rank: int = 0) -> None:
        self.signals = signals
        self.rank = rank
        self.received: Received | None = None
        self._previous: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = Received(int(signum), time.time())

    def _log_arrivals(self, read_fd: int) -> None:
        """The wakeup pipe's reader: one line per arriving pre-emption signal, until closed."""
        wanted = {int(s) for s in self.signals}
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in wanted:
                    line = SIGNAL_NOTED.format(rank=self.rank, signum=signum)
                    with contextlib.suppress(OSError):
                        os.write(2, (line + "\n").encode())

    def install(self) -> StopSignals:
        """Handle `signals` from now on (in the main thread, as Python requires)."""
        for sig in self.signals:
            self._previous[int(sig)] = signal.signal(sig, self._note)
            with contextlib.suppress(OSError, ValueError):
                signal.siginterrupt(sig, False)  # restart the system calls it interrupts
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._pipe = (read_fd, write_fd)
        threading.Thread(target=self._log_arrivals, args=(read_fd,), name="flashcp-signals",
                         daemon=True).start()  # fmt: skip
        return self

    def uninstall(self) -> None:
        """Put back the handlers `install` replaced (the default where it replaced one set
        outside Python): after training, SIGTERM ends the rank again at once."""
        for signum, handler in self._previous.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._pipe is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(-1)
            for fd in reversed(self._pipe):  # the write end first: the reader sees the end
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None

    def __call__(self) -> int:
        return 0 if self.received is None else self.received.signum
