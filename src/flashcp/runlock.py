"""One job per run directory: the lock `<run.output_dir>/.flashcp.lock`, held for the job's life.

Two jobs writing one run directory destroy each other (checkpoints pruned from under a resume,
`metrics.jsonl` interleaved, a `goodput.json` renamed away). So a job holds this lock from
before its launch to its end, and a second job is refused before it launches:

* `flashcp train` and `flashcp eval` take it (`acquire`; node 0 of a multi-node job, for the
  whole job: the other nodes check that node 0 of their job holds it, `job_holder`) and hand
  its token to their ranks (`ENV_TOKEN`), which check that it is still their job's
  (`check_token`);
* ranks started by `paddle.distributed.launch` directly take it themselves (`join`): the first
  rank of the job to come holds it, the others find their own job's token in it (the job is
  named by its launcher's rendezvous, `paddle_token`).

The file records the holder (`Holder`: what it is, host, PID, start time, command, and for a
multi-node job the `--master` and node count); the lock itself is an exclusive `flock` on it,
which the kernel drops when the holding process dies, however it dies. A lock left by a job
that is gone is taken over, with a note (`Held.note`): on the same machine (the same kernel:
`/proc/sys/kernel/random/boot_id`) the `flock` says so at once; where `flock` is not supported
(some network file systems), a holder on this host whose PID is gone; a holder on another host
whose heartbeat (the file's mtime, refreshed every `HEARTBEAT_S` s) is older than
`FLASHCP_LOCK_STALE_S` (`STALE_S` by default). The holder removes the file when it ends.

It imports only the run directory's names (`flashcp.rundir`) and the refusal
(`flashcp.problems`: a refusal is a `Problem` keyed `run.output_dir`, `lock_problem`);
`flashcp.runstart` and `flashcp.launch` use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashcp.problems import Problem, ProblemsError
from flashcp.rundir import LOCK_FILE

OUTPUT_DIR = "run.output_dir"
"""The key a lock's refusal is reported under."""
ENV_TOKEN = "FLASHCP_RUN_LOCK"
"""The token of the lock a job's `flashcp train` (or `flashcp eval`) holds, in its ranks'
environment."""
ENV_STALE_S = "FLASHCP_LOCK_STALE_S"
"""Seconds after its last heartbeat at which another host's lock counts as left by a dead job."""
HEARTBEAT_S = 10.0
"""How often the holder refreshes the file's mtime (its heartbeat)."""
STALE_S = 120.0
"""The default of `FLASHCP_LOCK_STALE_S`."""
RETRY_S = 1.0
"""How long `acquire` retries a `flock` another process holds for a moment (a `probe`)."""
RECORD_WAIT_S = 10.0
"""How long a rank of a job started directly waits for the record of the rank that took the
lock first (it is written right after the `flock`)."""
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
"""`flock` errors of a file system that does not support it: the record alone decides."""


def boot_id() -> str:
    """This kernel's boot id (containers of one machine share it; '' where there is none)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory's lock (the file's content)."""

    what: str
    """`flashcp train`, `flashcp eval`, or `paddle.distributed.launch` (ranks started directly)."""
    pid: int
    """The process to stop to end the job (`flashcp train`'s, or the ranks' launcher's)."""
    host: str = field(default_factory=socket.gethostname)
    started: float = field(default_factory=time.time)
    command: str = ""
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    master: str | None = None
    """`--master` of a multi-node job (its other nodes check it, `job_holder`)."""
    nnodes: int = 1
    boot: str = field(default_factory=boot_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file records (None: empty, or not a record of this module)."""
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        """`flashcp train (pid 123 on host h, started 2026-12-02 06:34:17, `flashcp ...`)`."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        command = f", `{self.command}`" if self.command else ""
        return f"{self.what} (pid {self.pid} on {self.host}, started {when}{command})"


class RunLockError(ProblemsError, RuntimeError):
    """The run directory is in use by another job: its problem (`lock_problem`, keyed
    `run.output_dir`) names the holder and the ways out, printed as one line `key: message`.
    (A `RuntimeError` too, as it was.)"""

    kind = ""

    def __init__(self, problem: Problem, holder: Holder | None = None) -> None:
        self.holder = holder
        super().__init__([problem])


def stale_seconds(environ: Mapping[str, str] | None = None) -> float:
    """`FLASHCP_LOCK_STALE_S` (a positive number), else `STALE_S`."""
    raw = (os.environ if environ is None else environ).get(ENV_STALE_S, "")
    try:
        value = float(raw)
    except ValueError:
        return STALE_S
    return value if value > 0 else STALE_S


def _flock(fd: int, how: int) -> str:
    """`flock(fd, how | LOCK_NB)`: 'got', 'held' (another holder) or 'unsupported'."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return "held"
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return "unsupported"
        raise
    return "got"


def _read(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return Holder.parse(b"".join(chunks).decode("utf-8", "replace"))


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclass(frozen=True)
class Verdict:
    """Whether a lock's holder still holds it (`live`), and if not, why (`why`)."""

    live: bool
    why: str = ""


def judge(holder: Holder | None, flock: str, age_s: float, stale_s: float) -> Verdict:
    """Whether `holder` (the record; None: none) still holds the lock, given what `flock` said
    ('held', 'got' or 'unsupported') and the seconds since its last heartbeat (module
    docstring)."""
    if flock == "held":
        return Verdict(True)
    if holder is None:
        return Verdict(False)
    same_machine = holder.boot == boot_id() if holder.boot and boot_id() else (
        holder.host == socket.gethostname()
    )  # fmt: skip
    if same_machine and flock == "got":  # the kernel dropped its flock: it ended
        gone = holder.host == socket.gethostname() and _pid_gone(holder.pid)
        return Verdict(False, f"which is gone (pid {holder.pid} no longer runs)" if gone
                       else "which no longer holds it")  # fmt: skip
    if same_machine and holder.host == socket.gethostname():  # flock unsupported: the PID says
        if _pid_gone(holder.pid):
            return Verdict(False, f"which is gone (pid {holder.pid} does not run)")
        return Verdict(True)
    if age_s > stale_s:
        return Verdict(False, f"whose heartbeat stopped {age_s:.0f} s ago (more than "
                       f"{ENV_STALE_S} {stale_s:g} s)")  # fmt: skip
    return Verdict(True)


def lock_problem(output_dir: str | Path, holder: Holder | None, *, stale_s: float) -> Problem:
    """The refusal of a second job on `output_dir` (keyed `run.output_dir`): the holder and the
    ways out."""
    path = Path(output_dir) / LOCK_FILE
    if holder is None:
        return Problem(
            OUTPUT_DIR, f"{output_dir} is in use by another job (its lock {path} is held and "
            "names no holder yet)",
            other="wait for that job to end, or choose another run.output_dir",
        )  # fmt: skip
    here = holder.host == socket.gethostname()
    stop = f"kill {holder.pid}" + ("" if here else f" on {holder.host}")
    tail = "" if here else (
        f"; a lock whose heartbeat stopped is taken over after {ENV_STALE_S} {stale_s:g} s"
    )  # fmt: skip
    return Problem(
        OUTPUT_DIR, f"{output_dir} is in use by {holder.describe()}",
        other=f"wait for that job to end or stop it ({stop}; run the same command again to "
        f"resume it), or choose another run.output_dir{tail}",
    )  # fmt: skip


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a holder that ended unlinked it)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class Held:
    """A lock this process holds: its file open and `flock`ed, its heartbeat running, until
    `release`. `note`: what was taken over (a lock left by a job that is gone), or None."""

    def __init__(self, path: Path, fd: int, holder: Holder, note: str | None) -> None:
        self.path, self.fd, self.holder, self.note = path, fd, holder, note
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="flashcp-runlock",
                                      daemon=True)  # fmt: skip
        self._beat.start()

    @property
    def token(self) -> str:
        return self.holder.token

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.fd if os.utime in os.supports_fd else self.path)

    def release(self, moved_to: str | Path | None = None) -> None:
        """Remove the file (from `moved_to`, the directory it was moved to with its run, when
        given) and drop the lock. Idempotent."""
        self._stop.set()
        if self.fd < 0:
            return
        path = Path(moved_to) / LOCK_FILE if moved_to is not None else self.path
        if _same_file(self.fd, path):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def _open(path: Path, *, create: bool) -> int | None:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None


def _age(fd: int) -> float:
    return max(0.0, time.time() - os.fstat(fd).st_mtime)


def probe(output_dir: str | Path, *, stale_s: float | None = None) -> None:
    """Raise `RunLockError` when a live job holds `output_dir`'s lock; creates nothing and
    takes nothing (a check before the checks that may move or write)."""
    path = Path(output_dir) / LOCK_FILE
    limit = stale_seconds() if stale_s is None else stale_s
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or none readable: `acquire` says what is wrong)
    try:
        state = _flock(fd, fcntl.LOCK_SH)
        holder = _read(fd)
        if judge(holder, state, _age(fd), limit).live:
            raise RunLockError(lock_problem(output_dir, holder, stale_s=limit), holder)
    finally:
        os.close(fd)


def acquire(
    output_dir: str | Path,
    holder: Holder,
    *,
    stale_s: float | None = None,
    retry_s: float = RETRY_S,
) -> Held:
    """Take `output_dir`'s lock for `holder` (creating the directory and the file); raise
    `RunLockError` when a live job holds it, `OSError` when the file cannot be made. A lock
    left by a job that is gone is taken over (`Held.note`)."""
    out = Path(output_dir)
    path = out / LOCK_FILE
    limit = stale_seconds() if stale_s is None else stale_s
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + retry_s
    while True:
        fd = _open(path, create=True)
        assert fd is not None
        try:
            state = _flock(fd, fcntl.LOCK_EX)
            if state == "held" and time.monotonic() < deadline:
                os.close(fd)
                time.sleep(0.05)
                continue
            if state != "held" and not _same_file(fd, path):
                os.close(fd)  # its holder removed it as we opened it: open the new one
                continue
            found = _read(fd)
            verdict = judge(found, state, _age(fd), limit)
            if verdict.live:
                raise RunLockError(lock_problem(out, found, stale_s=limit), found)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        data = holder.to_json().encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        note = None
        if found is not None and verdict.why:
            note = (f"run.output_dir {out} was locked by {found.describe()}, {verdict.why}: "
                    "taken over")  # fmt: skip
        return Held(path, fd, holder, note)


def read_holder(output_dir: str | Path) -> tuple[Holder | None, bool]:
    """`(holder, live)` of `output_dir`'s lock ((None, False): no lock)."""
    path = Path(output_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, False
    try:
        state = _flock(fd, fcntl.LOCK_SH)
        holder = _read(fd)
        return holder, judge(holder, state, _age(fd), stale_seconds()).live
    finally:
        os.close(fd)


def check_token(output_dir: str | Path, token: str) -> None:
    """A rank of a job whose `flashcp train` holds the lock (`ENV_TOKEN`): raise
    `RunLockError` unless `output_dir`'s lock still carries `token`."""
    holder, _ = read_holder(output_dir)
    if holder is not None and holder.token == token:
        return
    limit = stale_seconds()
    if holder is None:
        raise RunLockError(Problem(
            OUTPUT_DIR, f"{output_dir} is not locked by this rank's job (no {LOCK_FILE})",
            other="start the job with `flashcp train`, or run.output_dir is not the directory "
            "its flashcp train locked (a shared directory on every node?)",
        ))  # fmt: skip
    raise RunLockError(lock_problem(output_dir, holder, stale_s=limit), holder)


def paddle_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The token of a job started by `paddle.distributed.launch` directly, the same in each of
    its ranks on every node and different for every launch: its rendezvous (`PADDLE_MASTER`)
    and its ranks' endpoints. None outside such a launch."""
    env = os.environ if environ is None else environ
    endpoints = env.get("PADDLE_TRAINER_ENDPOINTS")
    if not endpoints:
        return None
    key = f"{env.get('PADDLE_MASTER', '')}|{endpoints}"
    return "paddle-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def join(
    output_dir: str | Path,
    holder: Holder,
    *,
    wait_s: float = RECORD_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> Held | None:
    """A rank of a job started directly: take `output_dir`'s lock for the job (`holder.token`
    names it), or find that another rank of the job took it (None). Raises `RunLockError` when
    another job holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return acquire(output_dir, holder)
        except RunLockError as exc:
            if exc.holder is not None and exc.holder.token == holder.token:
                return None  # a peer rank of this job holds it
            if exc.holder is not None or time.monotonic() > deadline:
                raise
        sleep(0.1)  # held, its record not written yet: a peer's, or another job's

