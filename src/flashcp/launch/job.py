"""`flashcp train`: run a loaded config as a `paddle.distributed.launch` job and supervise it.

`run_job` takes the `Config` the CLI loaded (each rank loads its own copy from the same file
and overrides: they are separate processes), checks it (`flashcp.launch.preflight`: a problem
is one line and exit code 2, nothing launched), then launches `dp × pp × cp` processes of
`flashcp/train.py` (`flashcp.launch.worker`) with logs under `<run.output_dir>/logs` (the
launcher's own output in `launcher.log`, each rank's in `workerlog.<rank>`) and streams its
output here: the launcher echoes rank 0; its configuration banner and Paddle's C++ INFO lines
are left out (they stay in the log files), and the lines of rank 0's log it never echoed (it
echoes every 2 s, and not at all once it is stopped or a rank failed) follow when the launch
ends (`RankZeroEcho`). The last line says how the job ended, the step it saved (or none) and
its exit code (`outcome.ending_line`). The exit code is the job's.

The job is this process's: it holds `run.output_dir`'s lock for its whole life
(`flashcp.runlock`, taken by `preflight`; a second job there is refused before launch), and
the launcher is tethered to it (`flashcp.launch.lifeline`): SIGKILL `flashcp train` and the
launcher and every rank end with it, with nothing more written. A stop
(`flashcp.launch.supervise.stop`) reaches the launcher's process group, then every process
marked with the job's `FLASHCP_JOB_ID`, SIGKILL after a grace period.

More than one node (`Nodes`: `flashcp train --nnodes N --node-rank R --master HOST:PORT`):
each node's `flashcp train` launches dp·pp·cp / N processes with the launcher's `--nnodes N
--rank R --master HOST:PORT`, logging to `<run.output_dir>/logs/node<R>`. The launchers wait
for each other without a limit of their own, so `run_job` stops a node whose training
processes have not started within the init timeout (`rendezvous_lost`).

When the job fails, `flashcp.launch.outcome.failure_report` says which rank failed first and
how, which ranks only went down with it, and the failed rank's last log lines.

Long jobs. With `run.max_restarts` a failed launch is relaunched from the latest complete
checkpoint, after a backoff, unless a relaunch cannot fix it (`flashcp.launch.restart`; every
node of a multi-node job decides alike, `flashcp.launch.nodesync`); each restart is a line of
`restarts.jsonl`. SIGTERM or `run.preempt_signal` to `flashcp train` pre-empts: the signal is
passed on to every rank of this node, which finish their step, save and exit 75
(`flashcp.launch.preempt`); the job is stopped if that takes longer than
`run.preempt_grace_s`, and a second signal stops it at once. Ctrl-C (SIGINT) does the same
(the ranks get SIGTERM) and exits 130; Ctrl-C again stops the job at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from flashcp import rundir, runlock
from flashcp.attempt import Attempt
from flashcp.config import Config
from flashcp.distributed.watchdog import resolve_timeout
from flashcp.launch import lifeline, outcome, restart, supervise
from flashcp.launch.nodesync import NodeSync
from flashcp.launch.preempt import preempt_signals
from flashcp.launch.preflight import EXIT_PREFLIGHT, Nodes, PreflightError, Prepared, preflight
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


def _shown(line: str) -> bool:
    """Whether a line of the launcher's output (or of rank 0's log) reaches the console."""
    return not (
        line.startswith(_HIDDEN_PREFIXES)
        or _GLOG_INFO.match(line)
        or outcome.EXIT_LINE_RE.match(line)
        or any(n in line for n in _NOISE)
    )


class RankZeroEcho:
    """How far the launcher has echoed rank 0's log (this launch's part, from `offset`):
    Paddle's launcher copies its first rank's new lines to its output every 2 s, and stops
    copying when it is stopped or a rank fails, so the last lines rank 0 wrote — the save of a
    pre-emption, the summary of the run — may never reach the console. `saw` is fed the
    launcher's output line by line (a line that is rank 0's next one moves the mark on);
    `rest` is what it never echoed."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset = path, offset
        self._file: TextIO | None = None
        self._pending = ""

    def _next(self) -> str | None:
        """Rank 0's next whole line (not consumed), None when there is none yet."""
        if self._file is None:
            try:
                raw = open(self.path, "rb")  # noqa: SIM115 - kept open while the launch runs
            except OSError:
                return None
            raw.seek(self.offset)
            self._file = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        while not self._pending.endswith("\n"):
            more = self._file.readline()
            if not more:
                return None
            self._pending += more
        return self._pending

    def saw(self, line: str) -> None:
        """The launcher printed `line`: if it is rank 0's next one, it is echoed."""
        if self._next() == line:
            self._pending = ""

    def rest(self) -> list[str]:
        """Rank 0's lines the launcher did not echo (then closes the log)."""
        lines = []
        while (line := self._next()) is not None:
            lines.append(line)
            self._pending = ""
        if self._pending:  # a last line without its newline
            lines.append(self._pending + "\n")
            self._pending = ""
        if self._file is not None:
            self._file.close()
            self._file = None
        return lines


def pump(src: TextIO, log: TextIO, out: TextIO, echo: RankZeroEcho | None = None) -> None:
    """Copy the launcher's output to `launcher.log`, and all but its banner to `out`; until a
    rank fails (the launcher then re-prints a failed rank's log tail), tell `echo` each line."""
    failed = False
    for line in src:
        log.write(line)
        log.flush()
        failed = failed or _LAUNCHER_FAILED in line
        if failed:
            continue
        if echo is not None:
            echo.saw(line)
        if _shown(line):
            out.write(line)
            out.flush()


class Signals:
    """What `flashcp train` does with signals while its job runs (module docstring): the first
    pre-emption signal or Ctrl-C is passed on to the ranks (`preempting`; Ctrl-C as SIGTERM,
    which every rank takes as a request to save and stop), a second one stops at once
    (`stop`)."""

    def __init__(self, preempt: tuple[signal.Signals, ...]) -> None:
        self.preempt = preempt
        self.preempting: int | None = None
        self.preempted_at = 0.0
        self.stop: int | None = None
        self.passed_on: set[int] = set()
        """The ranks (pids) the pre-emption signal was passed on to."""
        self._previous: dict[int, Any] = {}

    def install(self) -> Signals:
        for sig in {signal.SIGINT, *self.preempt}:
            self._previous[int(sig)] = signal.signal(sig, self._on)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on(self, signum: int, _frame: object) -> None:
        if self.preempting is not None:
            self.stop = self.stop or signum
        else:
            self.preempting, self.preempted_at = signum, time.monotonic()

    @property
    def ctrl_c(self) -> bool:
        """The job is stopping on Ctrl-C (not on a pre-emption signal)."""
        return self.preempting == signal.SIGINT

    @property
    def passed(self) -> int:
        """The signal the ranks get: the pre-emption signal itself, SIGTERM for Ctrl-C."""
        return int(signal.SIGTERM if self.ctrl_c else (self.preempting or signal.SIGTERM))

    def pass_on(self, ranks: list[int]) -> list[int]:
        """Send the pre-emption signal to those of `ranks` (pids) that have not had it yet (a
        rank started after the signal came gets it too); returns them."""
        if self.preempting is None:
            return []
        fresh = [pid for pid in ranks if pid not in self.passed_on]
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, self.passed)
            self.passed_on.add(pid)
        return fresh

    def name(self, signum: int | None = None) -> str:
        """`Ctrl-C (SIGINT)`, `SIGTERM`, ...: the signal (default: the first) for a person."""
        sig = signal.Signals(signum or self.preempting or signal.SIGTERM)
        return "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name

    @property
    def code(self) -> int:
        """The exit code after a stop: 128 + the signal."""
        return 128 + int(self.stop or self.preempting or signal.SIGTERM)

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds`; False as soon as a signal came (`stop` or `preempting`)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop is not None or self.preempting is not None:
                return False
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        return self.stop is None and self.preempting is None


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


def _launch(
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
                    print(f"\n{_passed_on(signals, len(fresh), cfg)}", file=out, flush=True)
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
        if _shown(line):
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


def _passed_on(signals: Signals, ranks: int, cfg: Config) -> str:
    """The line that says a pre-emption (or Ctrl-C) reached the ranks."""
    grace = f"run.preempt_grace_s {cfg.run.preempt_grace_s:g} s"
    if signals.ctrl_c:
        return (f"flashcp: Ctrl-C: passed on to {ranks} rank(s) as SIGTERM; they finish the "
                f"step, save and stop ({grace}; Ctrl-C again stops them at once)")  # fmt: skip
    return (f"flashcp: pre-emption ({signals.name()}): passed on to {ranks} rank(s); they "
            f"finish the step, save and stop ({grace})")  # fmt: skip


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
    preflight (`preflight.check_config_file`)."""
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
        end = _run_launches(cfg, config, overrides, ready, out=out, progress=progress,
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


def _run_launches(
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
        ended = _launch(cfg, cmd, env, log_dir, offsets, out=out, nodes=nodes,
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
            return Ending(f"{_asked(signals)}, but the ranks did not save and stop within "
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
            return Ending(f"{_asked(signals)}: every rank saved and stopped",
                          signals.code if signals.ctrl_c else code, True)  # fmt: skip
        if signals.preempting is not None:  # asked to go: no relaunch
            return Ending(f"{_asked(signals)}, and the launch failed (exit {code})",
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
                return Ending(f"{_asked(signals)} before the relaunch", signals.code, True)
            return Ending(f"{_asked(signals)} before the relaunch", outcome.EXIT_PREEMPTED,
                          True)  # fmt: skip
        extra = more
        ready.lease = supervise.launcher_lease(os.environ, local)
        attempt = Attempt(attempt.index + 1, started, time.time())


def _asked(signals: Signals) -> str:
    """`stopped by Ctrl-C (SIGINT)` or `pre-empted (SIGTERM)`: what the first signal asked."""
    if signals.ctrl_c:
        return "stopped by Ctrl-C (SIGINT)"
    return f"pre-empted ({signals.name()})"


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
