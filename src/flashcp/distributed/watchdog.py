"""Timeouts for blocking communication: a watchdog thread that ends a stuck process.

A gloo (or NCCL) call that waits for a dead or diverged peer blocks inside C++ and cannot be
interrupted from Python. The calls do release the GIL, so a daemon thread keeps running: each
blocking call registers a deadline and a message (`watch`), and when a deadline passes the thread
writes the message plus every thread's stack to stderr and calls `os._exit(TIMEOUT_EXIT_CODE)`.
The launcher sees the non-zero exit and tears the rest of the job down, so a hang becomes a fast
failure that names the collective and the group.

NCCL calls return before the collective has run; the collectives therefore wait for the
device inside the watched block (`flashcp.distributed.collectives.wait_on_device`), so a hung
NCCL collective is caught here too, at the collective, not at some later synchronisation.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENV_TIMEOUT = "FLASHCP_COLLECTIVE_TIMEOUT"
ENV_INIT_TIMEOUT = "FLASHCP_INIT_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
DEFAULT_INIT_TIMEOUT = 300.0
TIMEOUT_EXIT_CODE = 124
"""Exit status of a process ended by the watchdog (the same as coreutils `timeout`)."""


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


def resolve_timeout(timeout: float | None = None, *, init: bool = False) -> float:
    """`timeout` if given, else `FLASHCP_COLLECTIVE_TIMEOUT` (or `FLASHCP_INIT_TIMEOUT`)."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)
    if init:
        return _seconds_from_env(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
    return _seconds_from_env(ENV_TIMEOUT, DEFAULT_TIMEOUT)


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


class Watchdog:
    """Deadlines for in-flight blocking calls, checked by one lazily started daemon thread.

    `on_expire(message)` runs on the watchdog thread when a deadline passes; the default ends
    the process. Tests pass a recording callable instead.
    """

    def __init__(self, on_expire: Callable[[str], None] = _die) -> None:
        self._on_expire = on_expire
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[float, str]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired: list[str] = []

    def arm(self, seconds: float, message: str) -> int:
        """Register a deadline `seconds` from now; returns a token for `disarm`."""
        with self._cond:
            token = next(self._tokens)
            self._pending[token] = (time.monotonic() + seconds, message)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="flashcp-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return token

    def disarm(self, token: int) -> None:
        with self._cond:
            self._pending.pop(token, None)
            self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._pending:
                    self._cond.wait()
                    continue
                token, (deadline, message) = min(self._pending.items(), key=lambda kv: kv[1][0])
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                del self._pending[token]
                self.fired.append(message)
                self._on_expire(message)

    @contextmanager
    def watch(self, seconds: float, message: str) -> Iterator[None]:
        """Arm for the duration of the `with` block."""
        token = self.arm(seconds, message)
        try:
            yield
        finally:
            self.disarm(token)


WATCHDOG = Watchdog()
"""The process-wide watchdog used by every flashcp collective."""
