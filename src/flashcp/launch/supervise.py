"""Run `python -m paddle.distributed.launch` as one supervised process tree, and stop all of it.

The launcher runs in its own session (process group), but each worker it starts may move to
another session, so the group alone does not reach them: every process of a job carries a
marker in its environment (`<marker_env>=<marker>`, by default `FLASHCP_JOB_ID`) and is found
through /proc (Linux). `stop` sends SIGTERM to the launcher's group and to every marked process,
then SIGKILL to what outlives the grace period; `leftover` finds (and kills) marked processes
that outlive the launcher. A launcher started `tether`ed ends with the process that started it,
even by SIGKILL (`flashcp.launch.lifeline`: its ranks end with it in turn).

`run_launch` is the blocking form used by the test harness (`tests/helpers/launch.py`)
and the benchmark scripts: the launcher draws its ports from a lease (`launcher_lease`), the
whole tree is killed when it outlives `timeout`, and the result carries every rank's log.
`flashcp train` (`flashcp.launch.launcher`) starts the same way (`Job.start`) and streams instead.
Nothing here knows about configs or training.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashcp.distributed import ports
from flashcp.launch import lifeline
from flashcp.rundir import LAUNCHER_LOG, worker_log

JOB_MARKER = "FLASHCP_JOB_ID"
"""The default environment variable that marks every process of a job."""
GRACE_SECONDS = 10.0
"""How long `stop` waits after SIGTERM before SIGKILL (and after SIGKILL before giving up)."""
KILL_GRACE = 2.0
"""The shorter grace of a job that has already failed or timed out."""
SURROUNDING_JOB = ("PADDLE_TRAINER", "PADDLE_MASTER", "MASTER_")
"""Environment prefixes a job never inherits: the identity of a job that started this one."""
REAP_TIMEOUT = 30.0
"""How long to wait for a stopped launcher's last output before giving up on it."""


def launcher_command(
    script: str | Path,
    script_args: Sequence[str],
    *,
    nproc: int,
    log_dir: str | Path,
    launcher_args: Sequence[str] = (),
) -> list[str]:
    """`python -m paddle.distributed.launch --nproc_per_node N --log_dir DIR ... SCRIPT ARGS`.

    The workers run under `sys.executable`, so `coverage`'s subprocess patch measures them."""
    return [
        sys.executable, "-m", "paddle.distributed.launch",
        "--nproc_per_node", str(nproc),
        "--log_dir", str(log_dir),
        *launcher_args,
        str(script), *script_args,
    ]  # fmt: skip


def launcher_lease(env: Mapping[str, str], nproc: int) -> ports.PortLease | None:
    """Lease the ports Paddle's launcher will pick for `nproc` local processes (its store and
    endpoints: `nproc` + 1, one spare) for the job's lifetime; its `env()` (`PORT_RANGE`)
    points the launcher at them. None when `env` sets PORT_RANGE itself. Raises RuntimeError
    when no ports are free (`flashcp.distributed.ports`: a port taken before rank 0 binds it
    aborts the job inside Paddle)."""
    if env.get("PORT_RANGE"):
        return None
    return ports.reserve(nproc + 2)


def job_env(
    marker: str,
    *,
    marker_env: str = JOB_MARKER,
    base: Mapping[str, str] | None = None,
    drop: tuple[str, ...] = SURROUNDING_JOB,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """`base` (default: this process's environment) without the variables starting with
    `drop`, marked with `marker_env=marker`, output unbuffered, then `extra`."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith(drop)}
    env.update({marker_env: marker, "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def marked_pids(marker: str, marker_env: str = JOB_MARKER) -> list[int]:
    """PIDs (not this process) whose environment has `marker_env=marker` (Linux /proc)."""
    needle = f"{marker_env}={marker}".encode()
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop(
    marker: str,
    proc: subprocess.Popen[Any] | None = None,
    *,
    marker_env: str = JOB_MARKER,
    grace: float = GRACE_SECONDS,
) -> list[int]:
    """SIGTERM `proc`'s process group and every marked process; SIGKILL what outlives `grace`
    seconds. Returns the marked PIDs signalled."""
    hit: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        for pid in marked_pids(marker, marker_env):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if pid not in hit:
                hit.append(pid)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            root_done = proc is None or proc.poll() is not None
            if root_done and not any(alive(p) for p in marked_pids(marker, marker_env)):
                return hit
            time.sleep(0.05)
    return hit


def leftover(
    marker: str, settle: float, *, marker_env: str = JOB_MARKER, grace: float = KILL_GRACE
) -> list[int]:
    """Marked processes still alive `settle` s from now (they are then killed): what outlived
    the launcher."""
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline and any(alive(p) for p in marked_pids(marker, marker_env)):
        time.sleep(0.1)
    left = [p for p in marked_pids(marker, marker_env) if alive(p)]
    if left:
        stop(marker, marker_env=marker_env, grace=grace)
    return left


@dataclass
class Job:
    """A started process tree: `proc` (in a session of its own) and every process marked
    `marker_env=marker`."""

    proc: subprocess.Popen[Any]
    marker: str
    marker_env: str = JOB_MARKER

    @classmethod
    def start(
        cls,
        cmd: Sequence[str],
        env: Mapping[str, str],
        *,
        marker_env: str = JOB_MARKER,
        tether: bool = False,
        **popen: Any,
    ) -> Job:
        """Start `cmd` in a new session; `env` must carry the marker (see `job_env`). `tether`:
        it ends when this process does, however this one ends (`lifeline.tethered`; start it
        from the thread that outlives it: the kernel ties it to that thread)."""
        marker = env[marker_env]
        argv = lifeline.tethered(cmd) if tether else list(cmd)
        proc = subprocess.Popen(argv, env=dict(env), start_new_session=True, **popen)
        return cls(proc, marker, marker_env)

    def stop(self, grace: float = GRACE_SECONDS) -> list[int]:
        """`stop` this job: the launcher's group and every marked process."""
        return stop(self.marker, self.proc, marker_env=self.marker_env, grace=grace)

    def wait(self, timeout: float | None, *, grace: float = KILL_GRACE) -> tuple[int, bool, Any]:
        """Wait up to `timeout` s (None: without limit) for `proc` to exit, reading its piped
        output; past the timeout the whole tree is stopped. Returns (exit code, timed out,
        output); the exit code is -9 after a timeout."""
        try:
            output, _ = self.proc.communicate(timeout=timeout)
            return int(self.proc.returncode), False, output
        except subprocess.TimeoutExpired:
            self.stop(grace)
        try:
            output, _ = self.proc.communicate(timeout=REAP_TIMEOUT)
        except subprocess.TimeoutExpired:  # a descendant holds the pipe open: give up on it
            self.proc.kill()
            output = None
        return -9, True, output

    def leftover(self, settle: float) -> list[int]:
        """`leftover` of this job."""
        return leftover(self.marker, settle, marker_env=self.marker_env)


@dataclass
class LaunchResult:
    """Outcome of one job run by `run_launch`."""

    cmd: list[str]
    returncode: int
    timed_out: bool
    duration: float
    log_dir: Path
    logs: dict[int, str]
    """Each rank's `workerlog.<rank>` ("" when it wrote none)."""
    launcher_output: str
    leftover: list[int] = field(default_factory=list)
    """Job processes still alive after the launcher exited (killed by `run_launch`)."""
    port_range: str = ""
    """`PORT_RANGE` the launcher drew its ports from (`first:last`)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def log(self, rank: int) -> str:
        return self.logs.get(rank, "")

    def summary(self, tail: int = 40) -> str:
        """Launcher output and each rank's log tail, for error messages."""
        parts = [
            f"cmd: {' '.join(self.cmd)}",
            f"returncode={self.returncode} timed_out={self.timed_out} "
            f"duration={self.duration:.1f}s leftover={self.leftover}",
            "--- launcher ---",
            *self.launcher_output.splitlines()[-tail:],
        ]
        for rank, text in sorted(self.logs.items()):
            parts += [f"--- rank {rank} ---", *text.splitlines()[-tail:]]
        return "\n".join(parts)


def run_launch(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    log_dir: str | Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    marker_env: str = JOB_MARKER,
    launcher_args: Sequence[str] = (),
    settle: float = 5.0,
) -> LaunchResult:
    """Launch `nproc` processes of `script` with `args`, logging to `log_dir`; never outlive
    `timeout` s.

    `env` is the launcher's whole environment (default `job_env` of a new marker; it must
    carry `marker_env`). On timeout the whole job is killed and `timed_out` is set (`returncode`
    is then -9). After the launcher exits, job processes that linger longer than `settle` s are
    killed and listed in `leftover`."""
    child_env = dict(job_env(uuid.uuid4().hex, marker_env=marker_env) if env is None else env)
    out_dir = Path(log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = launcher_command(script, args, nproc=nproc, log_dir=out_dir,
                           launcher_args=launcher_args)  # fmt: skip
    launcher_log = out_dir / LAUNCHER_LOG
    start = time.monotonic()
    with contextlib.ExitStack() as held:
        lease = launcher_lease(child_env, nproc)
        if lease is not None:
            held.callback(lease.release)
            child_env.update(lease.env())
        sink = held.enter_context(open(launcher_log, "wb"))
        job = Job.start(cmd, child_env, marker_env=marker_env, tether=True, stdout=sink,
                        stderr=subprocess.STDOUT)  # fmt: skip
        returncode, timed_out, _ = job.wait(timeout)
    duration = time.monotonic() - start
    left = job.leftover(settle)
    logs = {}
    for rank in range(nproc):
        path = worker_log(out_dir, rank)
        logs[rank] = path.read_text(errors="replace") if path.exists() else ""
    return LaunchResult(
        cmd=cmd,
        returncode=returncode,
        timed_out=timed_out,
        duration=duration,
        log_dir=out_dir,
        logs=logs,
        launcher_output=launcher_log.read_text(errors="replace"),
        leftover=left,
        port_range=child_env.get("PORT_RANGE", ""),
    )
