"""Run a script on N CPU processes via `python -m paddle.distributed.launch`, safely: the test
suite's defaults over the library's supervisor (`flashcp.launch.supervise`).

`run_launch` is the one entry point integration tests use:

* every process of the job (launcher and workers) carries a unique `FLASHCP_LAUNCH_ID` in its
  environment (the marker of `bench.jobs`, which starts the suite's `flashcp train` jobs, apart
  from the `FLASHCP_JOB_ID` a `flashcp train` under test gives its own job), so the job can be
  found and killed even though the launcher puts each worker in its own session (`setsid`) - a
  hung job never outlives its timeout;
* per-rank logs (`workerlog.<rank>`) and the launcher's own output are returned as text;
* `tests/` and `scripts/` first on `PYTHONPATH` (pytest's `pythonpath`), so a worker script
  imports `helpers` and `bench` as the tests do;
* `OMP_NUM_THREADS=1` per process, so N workers do not oversubscribe the cores, and no
  `PADDLE_*` / `MASTER_*` variable of a surrounding job is inherited;
* the launcher draws its ports (`PORT_RANGE`) from a lease (`flashcp.distributed.ports`) held
  until it exits: outside the ephemeral range and apart from every other job on the machine.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.jobs import MARKER_ENV, launch_env
from flashcp.launch import supervise
from flashcp.launch.supervise import LaunchResult
from helpers.paths import ROOT, TESTS


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


def child_env(marker: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """`bench.jobs.launch_env` (marked, one thread per process, no surrounding job's identity)
    with `tests/` and `scripts/` first on `PYTHONPATH` (workers import `helpers` and `bench` as
    the tests do), plus `extra`."""
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join([str(TESTS), str(ROOT / "scripts"), *([inherited] if inherited else [])])
    return launch_env(marker, {"PYTHONPATH": path, **(extra or {})})


def marked_pids(marker: str) -> list[int]:
    """PIDs of the test job `marker` (launcher, workers, a `flashcp train` and its job)."""
    return supervise.marked_pids(marker, MARKER_ENV)


def kill_marked(marker: str, grace: float = supervise.KILL_GRACE) -> list[int]:
    """SIGTERM every process of the job, then SIGKILL what survives `grace` s; returns PIDs hit."""
    return supervise.stop(marker, marker_env=MARKER_ENV, grace=grace)


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
    return supervise.run_launch(
        script, nproc, args,
        log_dir=out_dir,
        timeout=timeout,
        env=child_env(marker, env),
        marker_env=MARKER_ENV,
        launcher_args=["--job_id", f"flashcp-{marker[:8]}"],
        settle=settle,
    )  # fmt: skip
