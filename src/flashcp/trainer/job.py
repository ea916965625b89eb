"""`flashcp train`: run a config as a `paddle.distributed.launch` job and supervise it.

The job gets `dp × pp × cp` processes, logs under `<run.output_dir>/logs` (the launcher's own
output in `launcher.log`, each rank's in `workerlog.<rank>`), and its output is streamed here:
the launcher echoes rank 0; its configuration banner and Paddle's C++ INFO lines are left out
(they stay in the log files). The exit code is the
job's. Ctrl-C / SIGTERM stops everything: the launcher runs in its own process group, which is
sent SIGTERM (then SIGKILL after a grace period), and any worker the launcher moved to another
session is found by the job's unique `FLASHCP_JOB_ID` environment marker and stopped too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

JOB_MARKER = "FLASHCP_JOB_ID"
GRACE_SECONDS = 10.0
_HIDDEN_PREFIXES = ("LAUNCH INFO", "FLAGS(name=", "=====")
_NOISE = ("No ccache found", "warnings.warn(warning_message)", "Modified FLAGS detected")
_GLOG_INFO = re.compile(r"^I\d{4} ")  # glog INFO lines from Paddle's C++ side


def train_script() -> Path:
    """The file the launcher runs on every rank (`flashcp/train.py`)."""
    import flashcp.train

    return Path(flashcp.train.__file__).resolve()


def launch_command(
    config: str | Path, overrides: Sequence[str], nproc: int, log_dir: Path
) -> list[str]:
    """The `python -m paddle.distributed.launch ...` command for a job."""
    return [
        sys.executable, "-m", "paddle.distributed.launch",
        "--nproc_per_node", str(nproc),
        "--log_dir", str(log_dir),
        str(train_script()), "--config", str(config), *overrides,
    ]  # fmt: skip


def job_pids(marker: str) -> list[int]:
    """PIDs (not ours) whose environment has `FLASHCP_JOB_ID=marker` (Linux /proc)."""
    needle = f"{JOB_MARKER}={marker}".encode()
    found = []
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_job(proc: subprocess.Popen[bytes], marker: str, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM the launcher's group and the job's processes; SIGKILL what outlives `grace`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for pid in job_pids(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not any(_alive(p) for p in job_pids(marker)):
                return
            time.sleep(0.1)


def _pump(src: TextIO, log: TextIO, out: TextIO) -> None:
    """Copy the launcher's output to `launcher.log`, and all but its banner to `out`."""
    for line in src:
        log.write(line)
        log.flush()
        if (
            line.startswith(_HIDDEN_PREFIXES)
            or _GLOG_INFO.match(line)
            or any(n in line for n in _NOISE)
        ):
            continue
        out.write(line)
        out.flush()


def run_job(
    config: str | Path,
    overrides: Sequence[str],
    *,
    nproc: int,
    output_dir: str | Path,
    out: TextIO | None = None,
    progress: bool | None = None,
) -> int:
    """Launch the job, stream rank 0, return its exit code (130 after Ctrl-C, 143 SIGTERM)."""
    out = out or sys.stdout
    log_dir = Path(output_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("PADDLE_TRAINER", "PADDLE_MASTER", "MASTER_"))]:
        del env[key]  # never inherit a surrounding job's identity
    env.update({JOB_MARKER: marker, "PYTHONUNBUFFERED": "1"})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
    if progress is None:
        progress = out.isatty() if hasattr(out, "isatty") else False
    env.setdefault("FLASHCP_PROGRESS", "1" if progress else "0")
    cmd = launch_command(config, overrides, nproc, log_dir)
    print(f"flashcp: launching {nproc} process(es); logs in {log_dir}", file=out, flush=True)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(log_dir / "launcher.log", "w") as log:
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, log, out), daemon=True)
            pump.start()
            while proc.poll() is None and not received:
                time.sleep(0.1)
            if received:
                print(f"\nflashcp: stopping the job (signal {received[0]})", file=out, flush=True)
                stop_job(proc, marker)
            proc.wait()
            pump.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        return 128 + received[0]
    return int(proc.returncode)
