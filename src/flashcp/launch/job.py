"""`flashcp train`: run a loaded config as a `paddle.distributed.launch` job and supervise it.

`run_job` takes the `Config` the CLI loaded (each rank loads its own copy from the same file
and overrides: they are separate processes), checks it (`flashcp.launch.preflight`: a problem
is one line and exit code 2, nothing launched), then launches `dp × pp × cp` processes of
`flashcp/train.py` (`flashcp.launch.worker`) with logs under `<run.output_dir>/logs` (the
launcher's own output in `launcher.log`, each rank's in `workerlog.<rank>`) and streams its
output here: rank 0's lines, without the launcher's banner and Paddle's C++ INFO lines
(`flashcp.launch.console`). One launch, run to its end, is `flashcp.launch.launcher`'s. The
last line says how the job ended, the step it saved (or none) and its exit code
(`outcome.ending_line`). The exit code is the job's.

The job is this process's: it holds `run.output_dir`'s lock for its whole life
(`flashcp.runlock`, taken by `preflight`; a second job there is refused before launch), and
the launcher is tethered to it (`flashcp.launch.lifeline`): SIGKILL `flashcp train` and the
launcher and every rank end with it, with nothing more written. A stop
(`flashcp.launch.supervise.stop`) reaches the launcher's process group, then every process
marked with the job's `FLASHCP_JOB_ID`, SIGKILL after a grace period.

More than one node (`Nodes`: `flashcp train --nnodes N --node-rank R --master HOST:PORT`):
each node's `flashcp train` launches dp·pp·cp / N processes with the launcher's `--nnodes N
--rank R --master HOST:PORT`, logging to `<run.output_dir>/logs/node<R>`; a node whose
training processes have not started within the init timeout is stopped
(`flashcp.launch.launcher.rendezvous_lost`).

When the job fails, `flashcp.launch.outcome.failure_report` says which rank failed first and
how, which ranks only went down with it, and the failed rank's last log lines.

Long jobs. With `run.max_restarts` a failed launch is relaunched from the latest complete
checkpoint, after a backoff, unless a relaunch cannot fix it (`flashcp.launch.restart`; every
node of a multi-node job decides alike, `flashcp.launch.nodesync`); each restart is a line of
`restarts.jsonl`. SIGTERM or `run.preempt_signal` pre-empts and Ctrl-C stops
(`flashcp.launch.signals`): the ranks save and stop, and the job is not relaunched.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from flashcp import rundir, runlock
from flashcp.attempt import Attempt
from flashcp.config import Config
from flashcp.launch import lifeline, outcome, restart, supervise
from flashcp.launch.launcher import Ended, launch_command, rendezvous_timeout, stream_launch
from flashcp.launch.nodesync import NodeSync
from flashcp.launch.preempt import preempt_signals
from flashcp.launch.preflight import EXIT_PREFLIGHT, Nodes, PreflightError, Prepared, preflight
from flashcp.launch.signals import Signals
from flashcp.log import python_warnings
from flashcp.run_info import COMMAND_ENV


@dataclass(frozen=True)
class Ending:
    """How `flashcp train` ends: what its last line says (`outcome.ending_line`), its code."""

    how: str
    code: int
    interrupted: bool = False
    """Stopped from outside (a signal, a killed launcher): the same command resumes it."""


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
    ranks are given to load it themselves), stream rank 0, relaunch it after failures a
    relaunch can fix (`run.max_restarts`), end with the line that says how it ended, and
    return the job's exit code (the blamed rank's own code when it gave one: `outcome.job_code`;
    75 pre-empted; 130 after Ctrl-C, 128 + the signal after any other stop, or after the
    launcher was killed by it).

    With `nodes` (several), this node launches its share of `cfg.parallel.world_size` and
    joins the others at `nodes.master` (node 0 alone moves an earlier run aside and holds the
    run directory's lock for the job). `command`: the command line as typed, recorded by the
    ranks in run_info.json and in the lock. `evaluate`: a `flashcp eval` job (the ranks
    evaluate; `preflight(evaluating=True)`). `checked`: the caller already ran the config's
    preflight (`flashcp.preflight.check_config_file`)."""
    out = out or sys.stdout
    nodes = nodes or Nodes()
    started = time.time()
    try:
        ready = preflight(cfg, nodes, say=lambda text: print(text, file=out, flush=True),
                          evaluating=evaluate, checked=checked,
                          command=command or shlex.join(sys.argv))  # fmt: skip
    except PreflightError as exc:
        print(f"flashcp: cannot launch: {exc}", file=sys.stderr, flush=True)
        return EXIT_PREFLIGHT
    if progress is None:
        progress = out.isatty() if hasattr(out, "isatty") else False
    before = restart.newest_checkpoint(cfg.run.output_dir)
    signals = Signals(preempt_signals(cfg.run.preempt_signal)).install()
    try:
        end = _stream_launches(cfg, config, overrides, ready, out=out, progress=progress,
                            nodes=nodes, command=command, evaluate=evaluate, signals=signals,
                            started=started)  # fmt: skip
    finally:
        signals.uninstall()
        ready.release()
    after = None if evaluate else restart.newest_checkpoint(cfg.run.output_dir)
    saved = after if after is not None and after != before else None
    print(outcome.ending_line(end.how, end.code, saved=saved, newest=after,
                              interrupted=end.interrupted, training=not evaluate),
          file=out, flush=True)  # fmt: skip
    return end.code


def _stream_launches(
    cfg: Config,
    config: str | Path,
    overrides: Sequence[str],
    ready: Prepared,
    *,
    out: TextIO,
    progress: bool,
    nodes: Nodes,
    command: str | None,
    evaluate: bool,
    signals: Signals,
    started: float,
) -> Ending:
    """`run_job`'s launches, relaunches included, to the `Ending` of the job."""
    nproc = cfg.parallel.world_size
    local = nproc // nodes.count
    sync = NodeSync(cfg.run.output_dir, nodes.rank, nodes.count) if nodes.multi else None
    if sync is not None:
        sync.reset()
    extra: list[str] = []
    attempt = Attempt(0, started, started)
    while True:
        log_dir = ready.log_dir
        offsets = outcome.log_sizes(log_dir, local)
        env = supervise.job_env(uuid.uuid4().hex, extra=attempt.env())
        # the launcher imports Paddle before any flashcp code: its known notices, by message
        env["PYTHONWARNINGS"] = python_warnings(env.get("PYTHONWARNINGS"))
        if command is not None:
            env[COMMAND_ENV] = command
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
        env.setdefault("FLASHCP_PROGRESS", "1" if progress else "0")
        env[lifeline.ENV_OWNER_PID] = str(os.getpid())
        if ready.token is not None:
            env[runlock.ENV_TOKEN] = ready.token
        if ready.lease is not None:
            env.update(ready.lease.env())
        cmd = launch_command(config, [*overrides, *extra], local, log_dir,
                             ready.master_port, nodes, evaluate)  # fmt: skip
        print(f"flashcp: launching {local} process(es){_where(nodes, local, nproc)}"
              f"{_restarted(attempt)}; logs in {log_dir}", file=out, flush=True)  # fmt: skip
        ended = stream_launch(cfg, cmd, env, log_dir, offsets, out=out, nodes=nodes,
                        signals=signals, sync=sync, attempt=attempt.index)  # fmt: skip
        if ready.lease is not None:
            ready.lease.release()
            ready.lease = None
        if ended.code == 0 and not ended.stopped:
            return Ending("evaluated" if evaluate else "finished", 0)
        if signals.stop is not None:
            return Ending(f"stopped at once ({signals.name(signals.stop)} after "
                          f"{signals.name()})", signals.code, True)  # fmt: skip
        if ended.stopped and signals.preempting is not None:
            return Ending(f"{signals.asked()}, but the ranks did not save and stop within "
                          f"run.preempt_grace_s {cfg.run.preempt_grace_s:g} s: stopped",
                          signals.code, True)  # fmt: skip
        if ended.unmet:
            return Ending(f"not started: the {nodes.count} nodes did not all meet at --master "
                          f"{nodes.master}", EXIT_PREFLIGHT)  # fmt: skip
        code = _report(ended, out, log_dir, nodes.rank * local)
        if code == outcome.EXIT_PREEMPTED:
            if signals.preempting is None:
                return Ending("pre-empted: every rank saved and stopped (a rank was signalled)",
                              code, True)  # fmt: skip
            return Ending(f"{signals.asked()}: every rank saved and stopped",
                          signals.code if signals.ctrl_c else code, True)  # fmt: skip
        if signals.preempting is not None:  # asked to go: no relaunch
            return Ending(f"{signals.asked()}, and the launch failed (exit {code})",
                          signals.code, True)  # fmt: skip
        budget = 0 if evaluate else cfg.run.max_restarts  # an evaluation is not restarted
        decision, more, step = _decide(cfg, ended, code, attempt.index, nodes, local, sync,
                                       budget)  # fmt: skip
        if not decision.restart:
            if decision.why:
                print(f"flashcp: not restarting: {decision.why}", file=out, flush=True)
            return Ending(_failed(ended, decision), decision.code,
                          ended.launcher_signal is not None)  # fmt: skip
        done = len(rundir.restart_records(cfg.run.output_dir)) + 1
        wait = restart.backoff_s(cfg.run.restart_backoff_s, attempt.index + 1)
        if nodes.rank == 0:
            record = restart.RestartRecord.of(decision, done, step, wait)
            restart.append_record(cfg.run.output_dir, record)
        where = f"checkpoint step {step}" if step is not None else "the start"
        print(f"flashcp: restart {attempt.index + 1} of {cfg.run.max_restarts} "
              f"(run.max_restarts) after {decision.cause} of rank {decision.rank}: "
              f"relaunching from {where} in {wait:g} s", file=out, flush=True)  # fmt: skip
        if not signals.sleep(wait):
            if signals.stop is not None or signals.ctrl_c:
                return Ending(f"{signals.asked()} before the relaunch", signals.code, True)
            return Ending(f"{signals.asked()} before the relaunch", outcome.EXIT_PREEMPTED,
                          True)  # fmt: skip
        extra = more
        ready.lease = supervise.launcher_lease(os.environ, local)
        attempt = Attempt(attempt.index + 1, started, time.time())


def _failed(ended: Ended, decision: restart.Decision) -> str:
    """How a failed job ended, for its last line."""
    if ended.launcher_signal is not None:
        return f"failed: Paddle's launcher was killed by {_signame(ended.launcher_signal)}"
    who = f" of rank {decision.rank}" if decision.rank is not None else ""
    return f"failed ({decision.cause}{who})"


def _signame(signum: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(signum).name
    return f"signal {signum}"


def _where(nodes: Nodes, local: int, nproc: int) -> str:
    if not nodes.multi:
        return ""
    first = nodes.rank * local
    return (f" as node {nodes.rank} of {nodes.count} (ranks {first}-{first + local - 1} of "
            f"{nproc}, rendezvous {nodes.master})")  # fmt: skip


def _restarted(attempt: Attempt) -> str:
    return f" (restart {attempt.index})" if attempt.relaunch else ""


def _report(ended: Ended, out: TextIO, log_dir: Path, rank_offset: int) -> int:
    """Print why the launch failed (unless it was a pre-emption); returns the job's code."""
    if ended.elsewhere is not None:
        return ended.elsewhere.code or 1
    if ended.launcher_signal is not None:
        print(outcome.launcher_killed(ended.code, ended.launcher_signal), file=out, flush=True)
        return ended.code
    code = outcome.job_code(ended.code, outcome.diagnose(ended.logs, ended.launcher_output))
    if code != outcome.EXIT_PREEMPTED:
        report = outcome.failure_report(code, ended.logs, ended.launcher_output, log_dir,
                                        rank_offset)  # fmt: skip
        print(report, file=out, flush=True)
    return code


def _decide(
    cfg: Config,
    ended: Ended,
    code: int,
    attempt: int,
    nodes: Nodes,
    local: int,
    sync: NodeSync | None,
    budget: int,
) -> tuple[restart.Decision, list[str], int | None]:
    """Whether to relaunch after a failed `attempt`, with the relaunch's overrides and the
    step it resumes from: this node's verdict alone, or node 0's decision from every node's
    (`local` processes per node; at most `budget` restarts)."""
    offset = nodes.rank * local
    if ended.elsewhere is not None:
        mine = restart.Report(nodes.rank, code, "peer lost", None, ended.stopped, time.time(),
                              "peer")  # fmt: skip
    elif ended.launcher_signal is not None:
        mine = restart.Report(nodes.rank, code, "killed", None,
                              outcome.launcher_killed_text(ended.launcher_signal), time.time(),
                              "killed")  # fmt: skip
    else:
        verdict = outcome.verdict(ended.code, outcome.diagnose(ended.logs, ended.launcher_output),
                                  offset)  # fmt: skip
        mine = restart.Report.of(nodes.rank, verdict)
    done = attempt  # restarts so far by this `flashcp train`
    if sync is None:
        decision = restart.decide({0: mine}, restarts=done, max_restarts=budget)
        more, step = restart.relaunch_overrides(cfg) if decision.restart else ([], None)
        return decision, more, step
    sync.report(attempt, mine)
    timeout = rendezvous_timeout()
    if nodes.rank == 0:
        reports = sync.reports(attempt, timeout)
        decision = restart.decide(reports, restarts=done, max_restarts=budget,
                                  nodes=nodes.count)  # fmt: skip
        more, step = restart.relaunch_overrides(cfg) if decision.restart else ([], None)
        sync.publish(attempt, decision, more, step)
        return decision, more, step
    got = sync.decision(attempt, timeout + 2 * rendezvous_timeout())
    if got is None:
        lost = restart.Decision(False, 1, "node lost", 0, None, "node 0 made no decision",
                                "node 0 is lost: start the same command on every node to "
                                "resume")  # fmt: skip
        return lost, [], None
    return got
