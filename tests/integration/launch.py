"""Run a script on N CPU processes via `python -m paddle.distributed.launch`, safely.

`run_launch` is the one entry point integration tests (and `scripts/stress_groups.py`) use:

* every process of the job (launcher and workers) carries a unique `FLASHCP_LAUNCH_ID` in its
  environment, so the job can be found and killed even though the launcher puts each worker in
  its own session (`setsid`) - a hung job never outlives its timeout;
* per-rank logs (`workerlog.<rank>`) and the launcher's own output are returned as text;
* `OMP_NUM_THREADS=1` per process, so N workers do not oversubscribe the cores;
* workers run under `sys.executable`, so `coverage`'s subprocess patch measures them;
* the launcher draws its ports (`PORT_RANGE`) from a lease (`flashcp.distributed.ports`) held
  until it exits: outside the ephemeral range and apart from every other job on the machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flashcp.distributed import ports

MARKER_ENV = "FLASHCP_LAUNCH_ID"


@dataclass
class LaunchResult:
    """Outcome of one launched job."""

    cmd: list[str]
    returncode: int
    timed_out: bool
    duration: float
    log_dir: Path
    logs: dict[int, str]
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
        """Launcher output and each rank's log tail, for assertion messages."""
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


def resolve_script(script_or_module: str | os.PathLike[str]) -> Path:
    """A `.py` path as is, or a dotted module name resolved to its source file."""
    text = os.fspath(script_or_module)
    path = Path(text)
    if text.endswith(".py") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"launch script {path} does not exist")
        return path.resolve()
    spec = importlib.util.find_spec(text)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise FileNotFoundError(f"{text!r} is neither a .py file nor an importable module")
    return Path(spec.origin)


def _marked_pids(marker: str) -> list[int]:
    """PIDs (other than ours) whose environment carries `FLASHCP_LAUNCH_ID=marker`."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_marked(marker: str, grace: float = 2.0) -> list[int]:
    """SIGTERM every process of the job, then SIGKILL what survives `grace` s; returns PIDs hit."""
    pids = _marked_pids(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            break
    return pids


def _read_logs(log_dir: Path, nproc: int) -> dict[int, str]:
    logs = {}
    for rank in range(nproc):
        path = log_dir / f"workerlog.{rank}"
        logs[rank] = path.read_text(errors="replace") if path.exists() else ""
    return logs


def run_launch(
    script_or_module: str | os.PathLike[str],
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    settle: float = 5.0,
) -> LaunchResult:
    """Launch `nproc` workers of `script_or_module` with `args`; never outlive `timeout` s.

    `env` entries are added to (and override) this process's environment. On timeout the whole
    job is killed and `timed_out` is set (`returncode` is then -9). After the launcher exits,
    job processes that linger longer than `settle` s are killed and listed in `leftover`.
    """
    script = resolve_script(script_or_module)
    marker = uuid.uuid4().hex
    out_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="flashcp-launch-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ)
    for key in [k for k in child_env if k.startswith(("PADDLE_", "MASTER_"))]:
        del child_env[key]  # never inherit a surrounding job's identity
    child_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", MARKER_ENV: marker})
    child_env.update(env or {})
    lease = None if child_env.get("PORT_RANGE") else ports.reserve(nproc + 2)
    if lease is not None:
        child_env.update(lease.env())  # the launcher's store and endpoint ports
    cmd = [
        sys.executable, "-m", "paddle.distributed.launch",
        "--nproc_per_node", str(nproc),
        "--log_dir", str(out_dir),
        "--job_id", f"flashcp-{marker[:8]}",
        str(script), *args,
    ]  # fmt: skip
    launcher_log = out_dir / "launcher.log"
    start = time.monotonic()
    timed_out = False
    with open(launcher_log, "wb") as sink, contextlib.ExitStack() as held:
        if lease is not None:
            held.callback(lease.release)
        proc = subprocess.Popen(
            cmd, env=child_env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_marked(marker)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = -9
    duration = time.monotonic() - start
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline and any(_alive(p) for p in _marked_pids(marker)):
        time.sleep(0.1)
    leftover = [p for p in _marked_pids(marker) if _alive(p)]
    if leftover:
        kill_marked(marker)
    return LaunchResult(
        cmd=cmd,
        returncode=returncode,
        timed_out=timed_out,
        duration=duration,
        log_dir=out_dir,
        logs=_read_logs(out_dir, nproc),
        launcher_output=launcher_log.read_text(errors="replace"),
        leftover=leftover,
        port_range=child_env.get("PORT_RANGE", ""),
    )
