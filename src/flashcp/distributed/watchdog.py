"""Timeouts for blocking communication: a watchdog thread that ends a stuck process.

A gloo (or NCCL) call that waits for a dead or diverged peer blocks inside C++ and cannot be
interrupted from Python. The calls do release the GIL, so a daemon thread keeps running: each
blocking call registers a deadline and a message (`watch`), and when a deadline passes the thread
writes the message plus every thread's stack to stderr and calls `os._exit(TIMEOUT_EXIT_CODE)`.
The launcher sees the non-zero exit and tears the rest of the job down, so a hang becomes a fast
failure that names the collective and the group.

NCCL calls return once the collective is queued on the device; a hung one never blocks the call
itself. Its Paddle task is handed to the same thread instead (`track`): the thread polls
`task.is_completed()` (a CUDA event query, `ProcessGroupNCCL::NCCLTask::IsCompleted`) every
`POLL_SECONDS`, off the training thread, and expires the collective's deadline as above if it
has not completed in time. No device synchronisation is needed on the hot path
(`flashcp.distributed.collectives.watch`); `FLASHCP_SYNC_COLLECTIVES=1` (debug) drains the
device after each NCCL collective instead, so a hang stops at the call with its host stack.

Start-up (`startup_phase`): until the first training step, load-time skew between ranks (every
rank reading its weights from shared storage) can exceed the collective timeout. Inside the
phase a collective without an explicit timeout waits `FLASHCP_STARTUP_TIMEOUT` (default 3600 s).
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ENV_TIMEOUT = "FLASHCP_COLLECTIVE_TIMEOUT"
ENV_INIT_TIMEOUT = "FLASHCP_INIT_TIMEOUT"
ENV_STARTUP_TIMEOUT = "FLASHCP_STARTUP_TIMEOUT"
ENV_SYNC = "FLASHCP_SYNC_COLLECTIVES"
DEFAULT_TIMEOUT = 300.0
DEFAULT_INIT_TIMEOUT = 300.0
DEFAULT_STARTUP_TIMEOUT = 3600.0
TIMEOUT_EXIT_CODE = 124
"""Exit status of a process ended by the watchdog (the same as coreutils `timeout`)."""
POLL_SECONDS = 0.2
"""How often the watchdog thread asks queued device work (NCCL tasks) whether it completed."""

_startup_depth = 0
"""> 0 while a `startup_phase` block runs (the trainer's build and resume)."""


def _seconds_from_env(key: str, default: float) -> float:
    raw = os.environ.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{key}={raw!r} must be > 0 seconds")
    return value


def resolve_timeout(
    timeout: float | None = None, *, init: bool = False, startup: bool = False
) -> float:
    """`timeout` if given, else `FLASHCP_INIT_TIMEOUT` (`init`), `FLASHCP_STARTUP_TIMEOUT`
    (`startup`, or any call inside `startup_phase`), else `FLASHCP_COLLECTIVE_TIMEOUT`."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)
    if init:
        return _seconds_from_env(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
    if startup or _startup_depth > 0:
        return _seconds_from_env(ENV_STARTUP_TIMEOUT, DEFAULT_STARTUP_TIMEOUT)
    return _seconds_from_env(ENV_TIMEOUT, DEFAULT_TIMEOUT)


@contextmanager
def startup_phase() -> Iterator[float]:
    """Inside the block, collectives without an explicit timeout wait the start-up timeout
    (yielded): the trainer's build and resume, where ranks drift apart by their load times."""
    global _startup_depth
    seconds = resolve_timeout(startup=True)  # a bad FLASHCP_STARTUP_TIMEOUT fails here
    _startup_depth += 1
    try:
        yield seconds
    finally:
        _startup_depth -= 1


def sync_collectives() -> bool:
    """Whether `FLASHCP_SYNC_COLLECTIVES` asks NCCL collectives to drain the device (debug)."""
    raw = os.environ.get(ENV_SYNC, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_SYNC}={raw!r}: use 1 (drain the device after each NCCL call) or 0")


def _save_coverage() -> None:
    """Write coverage data if this process is measured: `os._exit` skips coverage's atexit."""
    module = sys.modules.get("coverage")
    current = getattr(getattr(module, "Coverage", None), "current", None)
    cov = current() if current else None
    if cov is not None:
        with contextlib.suppress(Exception):
            cov.stop()
            cov.save()


def _die(message: str) -> None:
    """Default expiry action: message and stacks to stderr, then exit without cleanup."""
    with contextlib.suppress(Exception):  # about to exit: nothing may stop that
        sys.stdout.flush()
    os.write(2, ("\n" + message + "\n").encode("utf-8", "replace"))
    with contextlib.suppress(Exception):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    _save_coverage()
    os._exit(TIMEOUT_EXIT_CODE)


Message = str | Callable[[], str]
"""A timeout message, or a function building it (called only when the deadline passes)."""


def _text(message: Message) -> str:
    return message if isinstance(message, str) else message()


@dataclass
class _Queued:
    """Device work the watchdog polls: `done()` true once it ran; expires at `deadline`."""

    done: Callable[[], bool]
    deadline: float
    message: Message


class Watchdog:
    """Deadlines for in-flight blocking calls and queued device work, checked by one lazily
    started daemon thread.

    `on_expire(message)` runs on the watchdog thread when a deadline passes; the default ends
    the process. Tests pass a recording callable instead.
    """

    def __init__(
        self, on_expire: Callable[[str], None] = _die, *, poll_seconds: float = POLL_SECONDS
    ) -> None:
        self._on_expire = on_expire
        self._poll = poll_seconds
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[float, Message]] = {}
        self._queued: dict[str, deque[_Queued]] = {}
        self._wake_at = float("inf")
        """When the thread wakes next by itself (inf: not started)."""
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired: list[str] = []
        self.tracked = 0
        """Device work handed to `track` so far (tests count it)."""

    def _start(self) -> None:
        """Start the thread if it is not running (under the lock)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="flashcp-watchdog", daemon=True)
            self._thread.start()

    def arm(self, seconds: float, message: Message) -> int:
        """Register a deadline `seconds` from now; returns a token for `disarm`. The thread is
        woken only if its next tick (`poll_seconds` at most) comes after the new deadline."""
        with self._cond:
            token = next(self._tokens)
            deadline = time.monotonic() + seconds
            self._pending[token] = (deadline, message)
            self._start()
            if deadline < self._wake_at:
                self._cond.notify()
            return token

    def disarm(self, token: int) -> None:
        """Drop a deadline (the thread finds it gone when it next wakes)."""
        with self._cond:
            self._pending.pop(token, None)

    def track(
        self, queue: str, done: Callable[[], bool], seconds: float, message: Message
    ) -> None:
        """Expire with `message` unless `done()` is true within `seconds` (device work that
        runs after the call that queued it returned, e.g. an NCCL collective's task).

        `queue` names an in-order stream of such work (a group's communicator): the thread
        polls each queue from its oldest entry and stops at the first one not done, so a
        healthy run costs one `done()` per entry. Never blocks on the work itself.
        """
        entry = _Queued(done, time.monotonic() + seconds, message)
        with self._cond:
            self._queued.setdefault(queue, deque()).append(entry)
            self.tracked += 1
            self._start()
            if entry.deadline < self._wake_at:  # only a deadline sooner than the next tick
                self._cond.notify()

    @property
    def pending(self) -> int:
        """Armed deadlines plus queued device work not yet seen done."""
        with self._cond:
            return len(self._pending) + sum(len(q) for q in self._queued.values())

    def _poll_queued(self, now: float) -> list[str]:
        """Drop completed device work; return (and drop) the messages of expired work."""
        expired: list[str] = []
        for name in list(self._queued):
            queue = self._queued[name]
            while queue:
                try:
                    done = queue[0].done()
                except Exception as exc:  # a failed query is a failed collective  # noqa: BLE001
                    expired.append(f"{_text(queue.popleft().message)} (its completion check "
                                   f"raised {exc!r})")  # fmt: skip
                    continue
                if not done:
                    break
                queue.popleft()
            for entry in [e for e in queue if e.deadline <= now]:
                queue.remove(entry)
                expired.append(_text(entry.message))
            if not queue:
                del self._queued[name]
        return expired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                expired = self._poll_queued(now) if self._queued else []
                for token, (deadline, message) in sorted(
                    self._pending.items(), key=lambda kv: kv[1][0]
                ):
                    if deadline > now:
                        break
                    del self._pending[token]
                    expired.append(_text(message))
                for text in expired:
                    self.fired.append(text)
                    self._on_expire(text)
                if expired:
                    continue
                # Tick at least every poll interval, busy or not: a new deadline or queued work
                # then never needs to wake the thread (a wake-up per collective costs more than
                # the collective's own bookkeeping); only a deadline sooner than the tick does.
                wait = [d - now for d, _ in self._pending.values()]
                timeout = max(min([*wait, self._poll]), 0.0)
                self._wake_at = now + timeout
                self._cond.wait(timeout)

    @contextmanager
    def watch(self, seconds: float, message: Message) -> Iterator[None]:
        """Arm for the duration of the `with` block."""
        token = self.arm(seconds, message)
        try:
            yield
        finally:
            self.disarm(token)


WATCHDOG = Watchdog()
"""The process-wide watchdog used by every flashcp collective."""
