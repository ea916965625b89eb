"""Nothing outlives its job: Paddle's launcher ends with `flashcp train`, a rank with its launcher.

`flashcp train` starts `python -m paddle.distributed.launch` in a session of its own, and the
launcher starts each rank in a session of its own (`os.setsid`): a SIGKILL of `flashcp train` (a
closed terminal, the out-of-memory killer, a scheduler) or of the launcher reaches none of them,
and they would train on as orphans, writing into the run directory. Two ties, each from a
process to its parent, end them instead, without a word and without a save (a SIGKILL: whoever
killed the parent meant the job):

* `flashcp train` → launcher: the launcher is started through `tethered` — this module run as a
  short trampoline (`python -m flashcp.launch.lifeline PARENT_PID CMD...`) that asks the kernel
  for SIGKILL when its parent dies (`parent_death_signal`: Linux `prctl(PR_SET_PDEATHSIG)`),
  checks that its parent is still the one that started it (else it is already an orphan),
  records its own PID for the ranks (`ENV_LAUNCHER_PID`) and execs the launcher (same process).
* launcher → rank: every rank calls `hold` first thing (`flashcp/train.py`, before its imports):
  the same parent-death signal, the same orphan check, and a watchdog thread that SIGKILLs the
  rank once its parent is no longer the launcher it started under, or once `flashcp train`
  (`ENV_OWNER_PID`) is gone — where no parent-death signal exists (not Linux), and for the
  moment between a rank's start and its `prctl`. A rank of `python -m paddle.distributed.launch`
  started directly is tied to that launcher the same way.

Nothing here imports Paddle or the rest of flashcp: a rank runs it before its imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV_LAUNCHER_PID = "FLASHCP_LAUNCHER_PID"
"""The launcher's PID, set by the trampoline before it execs the launcher: its ranks' parent."""
ENV_OWNER_PID = "FLASHCP_OWNER_PID"
"""The PID of the `flashcp train` (or `flashcp eval`) that owns the job, set in its ranks'
environment: they end when it is gone."""
LAUNCHED_ENV = "PADDLE_TRAINER_ID"
"""Set by Paddle's launcher in every rank it starts: the mark of a process that has a launcher."""
POLL_S = 0.5
"""How often a rank's watchdog looks at its parent and owner."""
PR_SET_PDEATHSIG = 1
"""`prctl` option (linux/prctl.h): the signal this process gets when its parent dies."""
ORPHAN_EXIT = 128 + signal.SIGKILL
"""The trampoline's exit code when its parent was gone before it could tie itself to it."""


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (the thread that started
    it) dies; False where that does not exist (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _start_time(pid: int) -> str | None:
    """`pid`'s start time (clock ticks since boot, /proc/PID/stat field 22), to tell it from a
    later process that reuses its number; None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def pid_alive(pid: int, started: str | None = None) -> bool:
    """Whether `pid` runs (a zombie does not), and is still the process that started at
    `started` (`_start_time`) when that is given."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) said it exists
    if state == "Z":
        return False
    return started is None or _start_time(pid) in (None, started)


def _int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def tethered(cmd: Sequence[str], parent: int | None = None) -> list[str]:
    """`cmd` started through the trampoline (module docstring): it ends when process `parent`
    (default: this one) does. The trampoline execs `cmd[0]` (an absolute path, as
    `sys.executable` is) with `cmd` as its argv."""
    pid = os.getpid() if parent is None else parent
    return [sys.executable, "-m", "flashcp.launch.lifeline", str(pid), *cmd]


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Tie:
    """A rank's tie to its launcher (and to `flashcp train`): `hold` made it; its watchdog
    thread SIGKILLs this process once either is gone."""

    def __init__(self, parent: int, owner: int | None, poll_s: float = POLL_S) -> None:
        self.parent = parent
        self.owner = owner
        self.owner_started = _start_time(owner) if owner is not None else None
        self.poll_s = poll_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="flashcp-lifeline", daemon=True)

    def broken(self) -> str | None:
        """Why this process has outlived its job (None: it has not)."""
        if os.getppid() != self.parent:
            return f"its launcher (pid {self.parent}) is gone"
        if self.owner is not None and not pid_alive(self.owner, self.owner_started):
            return f"its flashcp train (pid {self.owner}) is gone"
        return None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.broken() is not None:
                _kill_self()  # nothing more is written: the job is over

    def start(self) -> Tie:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def hold(environ: Mapping[str, str] | None = None, poll_s: float = POLL_S) -> Tie | None:
    """Tie this rank to its launcher and to `flashcp train` (module docstring); None for a
    process no launcher started (no `LAUNCHED_ENV`: run by hand, or in a test). A rank whose
    launcher is already gone SIGKILLs itself here."""
    env = os.environ if environ is None else environ
    if LAUNCHED_ENV not in env:
        return None
    parent_death_signal()
    parent = os.getppid()  # after the prctl: a parent that died before it shows here
    launcher = _int(env.get(ENV_LAUNCHER_PID))
    if launcher is not None and parent != launcher and not pid_alive(launcher):
        _kill_self()  # the launcher died before this rank could tie itself to it
    return Tie(parent, _int(env.get(ENV_OWNER_PID)), poll_s).start()


def trampoline(argv: Sequence[str]) -> int:
    """`python -m flashcp.launch.lifeline PARENT_PID CMD...`: tie this process to PARENT_PID
    and exec CMD (returns only when it cannot)."""
    if len(argv) < 2 or _int(argv[0]) is None:
        print("usage: python -m flashcp.launch.lifeline PARENT_PID CMD [ARGS...]", file=sys.stderr)
        return 2
    parent_death_signal()
    if os.getppid() != int(argv[0]):
        return ORPHAN_EXIT  # the parent died before the tie: start nothing
    os.environ[ENV_LAUNCHER_PID] = str(os.getpid())
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.flush()
    os.execv(argv[1], list(argv[1:]))
    return 127  # pragma: no cover - execv returns only by raising


if __name__ == "__main__":
    sys.exit(trampoline(sys.argv[1:]))
