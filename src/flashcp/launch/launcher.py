"""One launch of Paddle's launcher, run to its end: its command line, the ranks it starts, the
nodes' rendezvous deadline, and what `flashcp train` watches while it runs.

`launch_command` is the `python -m paddle.distributed.launch` command of `flashcp/train.py`
(`train_script`) on this node's ranks. `stream_launch` starts it as a supervised process tree
tethered to this process (`flashcp.launch.supervise`, `flashcp.launch.lifeline`), streams its
output (`flashcp.launch.console`), passes a pre-emption on to the ranks
(`flashcp.launch.signals`), and stops it — after a second signal, past `run.preempt_grace_s`,
when the nodes did not all meet within the init timeout (`rendezvous_lost`: the launchers wait
for each other without a limit of their own), or when another node reports its launch failed
(`flashcp.launch.nodesync`). It says how the launch `Ended`; what follows (a report, a
relaunch) is `flashcp.launch.job`'s.
"""

from __future__ import annotations

import importlib.util
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from flashcp import rundir
from flashcp.config import Config
from flashcp.distributed.watchdog import resolve_timeout
from flashcp.launch import outcome, restart, supervise
from flashcp.launch.console import RankZeroEcho, pump, shown
from flashcp.launch.nodesync import NodeSync
from flashcp.launch.preflight import Nodes
from flashcp.launch.signals import Signals


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


def worker_pids(marker: str) -> list[int]:
    """The training processes of job `marker`: the processes that run `flashcp/train.py`."""
    script = str(train_script()).encode()
    found = []
    for pid in supervise.marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # a worker runs the script itself; the launcher only has it among its arguments
        if script in argv and b"paddle.distributed.launch" not in argv:
            found.append(pid)
    return found


def workers_started(marker: str) -> bool:
    """Whether the launcher of job `marker` has started its training processes (after the
    nodes met)."""
    return bool(worker_pids(marker))


def rendezvous_lost(nodes: Nodes) -> str:
    """The message when the nodes did not all meet at the master in time."""
    return (
        f"node {nodes.rank}: the {nodes.count} nodes did not all join at --master "
        f"{nodes.master} within {rendezvous_timeout():g} s (FLASHCP_INIT_TIMEOUT); stopped. "
        f"Start `flashcp train CONFIG --nnodes {nodes.count} --node-rank R --master "
        f"{nodes.master}` on every node R = 0..{nodes.count - 1}, with the same CONFIG and "
        "overrides"
    )


@dataclass
class Ended:
    """How one launch ended."""

    code: int
    """The launcher's exit code (0: every rank finished; 128 + N: the launcher itself was
    killed by signal N, `launcher_signal`)."""
    logs: dict[int, str | None] = field(default_factory=dict)
    launcher_output: str = ""
    stopped: str = ""
    """Why `flashcp train` stopped the job itself (empty: it ended by itself)."""
    elsewhere: restart.Report | None = None
    """Another node's failure report, which made this node stop its job."""
    unmet: bool = False
    """The nodes did not all meet within the init timeout (`rendezvous_lost`)."""
    launcher_signal: int | None = None
    """The signal that killed Paddle's launcher from outside (its ranks ended with it)."""


def stream_launch(
    cfg: Config,
    cmd: list[str],
    env: dict[str, str],
    log_dir: Path,
    offsets: dict[int, int],
    *,
    out: TextIO,
    nodes: Nodes,
    signals: Signals,
    sync: NodeSync | None,
    attempt: int,
) -> Ended:
    """Run one launch of the job to its end (module docstring); never outlives a stop, nor this
    process (the launcher is tethered to it, `lifeline`)."""
    launcher_log = log_dir / rundir.LAUNCHER_LOG
    offset = launcher_log.stat().st_size if attempt and launcher_log.is_file() else 0
    job = supervise.Job.start(
        cmd, env, tether=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        errors="replace",
    )  # fmt: skip
    stopped, elsewhere, unmet = "", None, False
    echo = RankZeroEcho(rundir.worker_log(log_dir, 0), offsets.get(0, 0))
    with open(launcher_log, "a" if attempt else "w") as log:
        assert job.proc.stdout is not None
        copier = threading.Thread(target=pump, args=(job.proc.stdout, log, out, echo),
                                  daemon=True)  # fmt: skip
        copier.start()
        deadline = time.monotonic() + rendezvous_timeout() if nodes.multi else None
        polled = passed = 0.0
        while job.proc.poll() is None:
            time.sleep(0.1)
            if signals.preempting is not None and time.monotonic() - passed > 1.0:
                passed = time.monotonic()
                if fresh := signals.pass_on(worker_pids(job.marker)):
                    print(f"\n{signals.notice(len(fresh), cfg.run.preempt_grace_s)}", file=out,
                          flush=True)  # fmt: skip
            if signals.stop is not None:
                stopped = f"stopping the job at once ({signals.name(signals.stop)} again)"
            elif signals.preempting is not None and (
                time.monotonic() - signals.preempted_at > cfg.run.preempt_grace_s
            ):
                stopped = (f"the ranks did not save and stop within run.preempt_grace_s "
                           f"{cfg.run.preempt_grace_s:g} s: stopping the job")  # fmt: skip
            elif deadline is not None and time.monotonic() > deadline:
                if workers_started(job.marker):
                    deadline = None
                else:
                    stopped, unmet = rendezvous_lost(nodes), True
            elif sync is not None and time.monotonic() - polled > 1.0:
                polled = time.monotonic()
                if (elsewhere := sync.failed_elsewhere(attempt)) is not None:
                    stopped = (f"node {elsewhere.node} reports that its launch failed (rank "
                               f"{elsewhere.rank} {elsewhere.text}): stopping this node's "
                               "ranks")  # fmt: skip
            if stopped:
                print(f"\nflashcp: {stopped}", file=out, flush=True)
                # a rank takes SIGTERM for a pre-emption: past its grace, it is killed
                job.stop(grace=supervise.KILL_GRACE)
                break
        job.proc.wait(timeout=supervise.REAP_TIMEOUT)  # exited, or stopped above
        copier.join(timeout=5)
    if supervise.marked_pids(job.marker):  # nothing of this launch outlives it
        supervise.stop(job.marker, grace=supervise.KILL_GRACE)
    for line in echo.rest():  # rank 0's last lines, which the launcher did not echo
        if shown(line):
            out.write(line)
    out.flush()
    code = int(job.proc.returncode)
    killed = -code if code < 0 and not stopped else None
    code = 128 - code if code < 0 else code
    if code == 0 and not stopped:
        return Ended(0)
    with open(launcher_log, "rb") as f:
        f.seek(offset)
        launcher_output = f.read().decode("utf-8", "replace")
    logs = outcome.read_rank_logs(log_dir, offsets)
    return Ended(code, logs, launcher_output, stopped, elsewhere, unmet, killed)
