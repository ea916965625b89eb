"""`flashcp train`: run a loaded config as a `paddle.distributed.launch` job and supervise it.

`run_job` takes the `Config` the CLI loaded (each rank loads its own copy from the same file
and overrides: they are separate processes), checks it (`flashcp.launch.preflight`: a problem
is one line and exit code 2, nothing launched), then launches `dp × pp × cp` processes of
`flashcp/train.py` (`flashcp.launch.worker`) with logs under `<run.output_dir>/logs` (the
launcher's own output in `launcher.log`, each rank's in `workerlog.<rank>`) and streams its
output here: the launcher echoes rank 0; its configuration banner and Paddle's C++ INFO lines
are left out (they stay in the log files). The exit code is the job's. Ctrl-C / SIGTERM stops
everything (`flashcp.launch.supervise.stop`: the launcher's process group, then every process
marked with the job's `FLASHCP_JOB_ID`, SIGKILL after a grace period).

More than one node (`Nodes`: `flashcp train --nnodes N --node-rank R --master HOST:PORT`):
each node's `flashcp train` launches dp·pp·cp / N processes with the launcher's `--nnodes N
--rank R --master HOST:PORT`, logging to `<run.output_dir>/logs/node<R>`. The launchers wait
for each other without a limit of their own, so `run_job` stops a node whose training
processes have not started within the init timeout (`rendezvous_lost`).

When the job fails, `flashcp.launch.outcome.failure_report` says which rank failed first and
how, which ranks only went down with it, and the failed rank's last log lines.
"""

from __future__ import annotations

import importlib.util
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

from flashcp.config import Config
from flashcp.distributed.watchdog import resolve_timeout
from flashcp.launch import outcome, supervise
from flashcp.launch.preflight import EXIT_PREFLIGHT, Nodes, PreflightError, preflight
from flashcp.log import python_warnings
from flashcp.run_info import COMMAND_ENV

_HIDDEN_PREFIXES = ("LAUNCH INFO", "FLAGS(name=", "=====")
_NOISE = (
    "No ccache found",
    "warnings.warn(warning_message)",
    "Modified FLAGS detected",
    " - HTTP Request: ",  # the launchers' rendezvous polls (multi-node)
)
_GLOG_INFO = re.compile(r"^I\d{4} ")  # glog INFO lines from Paddle's C++ side
_LAUNCHER_FAILED = "Container failed !!!"
"""After this line the launcher re-prints the failed rank's log tail (`failure_report` says it)."""


def train_script() -> Path:
    """The file the launcher runs on every rank (`flashcp/train.py`), found without importing
    it (it is a script: importing it would run nothing but cost the worker's imports)."""
    spec = importlib.util.find_spec("flashcp.train")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve()


def launch_command(
    config: str | Path,
    overrides: Sequence[str],
    nproc: int,
    log_dir: Path,
    master_port: int | None = None,
    nodes: Nodes | None = None,
    evaluate: bool = False,
) -> list[str]:
    """The `python -m paddle.distributed.launch ...` command for a job (`nproc` processes on
    this node; with `nodes.multi`, node `nodes.rank` of `nodes.count`; `evaluate`: the ranks
    evaluate instead of training, `flashcp eval`)."""
    master = ["--master", f"127.0.0.1:{master_port}"] if master_port else []
    if nodes is not None and nodes.master:
        master = ["--master", nodes.master]
    if nodes is not None and nodes.multi:
        master = ["--nnodes", str(nodes.count), "--rank", str(nodes.rank), *master]
    mode = ["--eval"] if evaluate else []
    return supervise.launcher_command(
        train_script(), ["--config", str(config), *mode, *overrides],
        nproc=nproc, log_dir=log_dir, launcher_args=master,
    )  # fmt: skip


def rendezvous_timeout() -> float:
    """How long (s) the launchers of a multi-node job may wait for each other: the init
    timeout (`FLASHCP_INIT_TIMEOUT`, default 300 s)."""
    return resolve_timeout(init=True)


def workers_started(marker: str) -> bool:
    """Whether the launcher of job `marker` has started its training processes (after the
    nodes met), i.e. a process of the job runs `flashcp/train.py`."""
    script = str(train_script()).encode()
    for pid in supervise.marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # a worker runs the script itself; the launcher only has it among its arguments
        if script in argv and b"paddle.distributed.launch" not in argv:
            return True
    return False


def rendezvous_lost(nodes: Nodes) -> str:
    """The message when the nodes did not all meet at the master in time."""
    return (
        f"node {nodes.rank}: the {nodes.count} nodes did not all join at --master "
        f"{nodes.master} within {rendezvous_timeout():g} s (FLASHCP_INIT_TIMEOUT); stopped. "
        f"Start `flashcp train CONFIG --nnodes {nodes.count} --node-rank R --master "
        f"{nodes.master}` on every node R = 0..{nodes.count - 1}, with the same CONFIG and "
        "overrides"
    )


def pump(src: TextIO, log: TextIO, out: TextIO) -> None:
    """Copy the launcher's output to `launcher.log`, and all but its banner to `out`."""
    failed = False
    for line in src:
        log.write(line)
        log.flush()
        failed = failed or _LAUNCHER_FAILED in line
        if (
            failed
            or line.startswith(_HIDDEN_PREFIXES)
            or _GLOG_INFO.match(line)
            or outcome.EXIT_LINE_RE.match(line)
            or any(n in line for n in _NOISE)
        ):
            continue
        out.write(line)
        out.flush()


def run_job(
    cfg: Config,
    config: str | Path,
    overrides: Sequence[str],
    *,
    out: TextIO | None = None,
    progress: bool | None = None,
    nodes: Nodes | None = None,
    command: str | None = None,
    evaluate: bool = False,
    checked: bool = False,
) -> int:
    """Check and launch the job of `cfg` (loaded from `config` with `overrides`, which the
    ranks are given to load it themselves), stream rank 0, return the job's exit code (the
    blamed rank's own code when it gave one: `outcome.job_code`; 130 after
    Ctrl-C, 143 SIGTERM).

    With `nodes` (several), this node launches its share of `cfg.parallel.world_size` and
    joins the others at `nodes.master` (node 0 alone moves an earlier run aside). `command`:
    the command line as typed, recorded by the ranks in run_info.json. `evaluate`: a
    `flashcp eval` job (the ranks evaluate; `preflight(evaluating=True)`). `checked`: the
    caller already ran the config's preflight (`preflight.check_config_file`)."""
    out = out or sys.stdout
    nodes = nodes or Nodes()
    nproc = cfg.parallel.world_size
    local = nproc // nodes.count
    try:
        ready = preflight(cfg, nodes, say=lambda text: print(text, file=out, flush=True),
                          evaluating=evaluate, checked=checked)  # fmt: skip
    except PreflightError as exc:
        print(f"flashcp: cannot launch: {exc}", file=sys.stderr, flush=True)
        return EXIT_PREFLIGHT
    log_dir = ready.log_dir
    offsets = outcome.log_sizes(log_dir, local)
    env = supervise.job_env(uuid.uuid4().hex)
    # the launcher imports Paddle before any flashcp code: its known notices, by message
    env["PYTHONWARNINGS"] = python_warnings(env.get("PYTHONWARNINGS"))
    if command is not None:
        env[COMMAND_ENV] = command
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
    if progress is None:
        progress = out.isatty() if hasattr(out, "isatty") else False
    env.setdefault("FLASHCP_PROGRESS", "1" if progress else "0")
    if ready.lease is not None:
        env.update(ready.lease.env())
    cmd = launch_command(config, overrides, local, log_dir, ready.master_port, nodes, evaluate)
    where = ""
    if nodes.multi:
        first = nodes.rank * local
        where = (f" as node {nodes.rank} of {nodes.count} (ranks {first}-{first + local - 1} of "
                 f"{nproc}, rendezvous {nodes.master})")  # fmt: skip
    print(f"flashcp: launching {local} process(es){where}; logs in {log_dir}", file=out,
          flush=True)  # fmt: skip
    job = supervise.Job.start(
        cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace",
    )  # fmt: skip
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(log_dir / "launcher.log", "w") as log:
            assert job.proc.stdout is not None
            copier = threading.Thread(target=pump, args=(job.proc.stdout, log, out), daemon=True)
            copier.start()
            deadline = time.monotonic() + rendezvous_timeout() if nodes.multi else None
            while job.proc.poll() is None and not received:
                time.sleep(0.1)
                if deadline is not None and time.monotonic() > deadline:
                    if workers_started(job.marker):
                        deadline = None
                    else:
                        print(f"flashcp: {rendezvous_lost(nodes)}", file=out, flush=True)
                        job.stop()
                        return EXIT_PREFLIGHT
            if received:
                print(f"\nflashcp: stopping the job (signal {received[0]})", file=out, flush=True)
                job.stop()
            job.proc.wait(timeout=supervise.REAP_TIMEOUT)  # exited, or stopped above
            copier.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if ready.lease is not None:
            ready.lease.release()
    if received:
        return 128 + received[0]
    code = int(job.proc.returncode)
    if code != 0:
        launcher_output = (log_dir / "launcher.log").read_text(errors="replace")
        logs = outcome.read_rank_logs(log_dir, offsets)
        code = outcome.job_code(code, outcome.diagnose(logs, launcher_output))
        report = outcome.failure_report(code, logs, launcher_output, log_dir, nodes.rank * local)
        print(report, file=out, flush=True)
    return code
