"""`flashcp train`: run a config as a `paddle.distributed.launch` job and supervise it.

The job gets `dp × pp × cp` processes, logs under `<run.output_dir>/logs` (the launcher's own
output in `launcher.log`, each rank's in `workerlog.<rank>`), and its output is streamed here:
the launcher echoes rank 0; its configuration banner and Paddle's C++ INFO lines are left out
(they stay in the log files). The exit code is the
job's. Ctrl-C / SIGTERM stops everything: the launcher runs in its own process group, which is
sent SIGTERM (then SIGKILL after a grace period), and any worker the launcher moved to another
session is found by the job's unique `FLASHCP_JOB_ID` environment marker and stopped too.

Before launching, `run_job` checks what the config cannot (`check_dispatch`, `check_memory`,
`master_port`, `check_run_dir`, `check_output_dir`): the FlashAttention flags in the environment
resolve for this model, the memory plan fits `hardware.memory_gib` (`flashcp plan`),
`FLASHCP_MASTER_PORT` (an optional fixed port for the launcher's master) is free,
the run may start in `run.output_dir` (no fresh run over an earlier run's checkpoints, see
`flashcp.launch.rundir`), and `run.output_dir` can be written. A problem is printed as one
line and the exit code is 2, with nothing launched and nothing written or moved. Then, with
`run.overwrite: true`, an earlier run in `run.output_dir` is moved aside (`rundir.move_aside`,
printed), and the last check creates the output directory.

More than one node (`Nodes`: `flashcp train --nnodes N --node-rank R --master HOST:PORT`):
each node's `flashcp train` launches dp·pp·cp / N processes with the launcher's `--nnodes N
--rank R --master HOST:PORT`, logging to `<run.output_dir>/logs/node<R>`. Node 0 checks the
master port is free (its launcher serves the rendezvous there) and alone moves an earlier run
aside; the other nodes first wait for that port (`check_master`, `FLASHCP_INIT_TIMEOUT`). The
launchers wait for each other without a limit of their own, so `run_job` stops a node whose
training processes have not started within the same timeout (`rendezvous_lost`).

When the job fails, `diagnose` reads each rank's log (the part written by this launch) and the
launcher's output and prints which rank failed first and how — killed without a word (SIGKILL,
the OOM killer), crashed on a signal, exited with its own error, timed out in a collective — and
which ranks only went down with it, followed by the failed rank's last log lines.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from flashcp.launch import rundir

if TYPE_CHECKING:
    from flashcp.distributed.ports import PortLease

JOB_MARKER = "FLASHCP_JOB_ID"
ENV_MASTER_PORT = "FLASHCP_MASTER_PORT"
"""A fixed port for the launcher's master (default: the launcher picks a free one)."""
GRACE_SECONDS = 10.0
EXIT_PREFLIGHT = 2
TAIL_LINES = 12
_HIDDEN_PREFIXES = ("LAUNCH INFO", "FLAGS(name=", "=====")
_NOISE = (
    "No ccache found",
    "warnings.warn(warning_message)",
    "Modified FLAGS detected",
    " - HTTP Request: ",  # the launchers' rendezvous polls (multi-node)
)
_GLOG_INFO = re.compile(r"^I\d{4} ")  # glog INFO lines from Paddle's C++ side
EXIT_LINE = re.compile(r"^\[flashcp\] rank (\d+) exit (-?\d+)\s*$", re.M)
"""A rank's last line (`flashcp.train.EXIT_LINE`)."""


def train_script() -> Path:
    """The file the launcher runs on every rank (`flashcp/train.py`)."""
    import flashcp.train

    return Path(flashcp.train.__file__).resolve()


@dataclass(frozen=True)
class Nodes:
    """This machine's place in a job over `count` nodes (`flashcp train --nnodes N --node-rank
    R --master HOST:PORT`): node `rank` runs processes `[rank·n, (rank+1)·n)` of the job, n =
    dp·pp·cp / count. `master` is the rendezvous of the launchers, served by node 0's."""

    count: int = 1
    rank: int = 0
    master: str | None = None

    @property
    def multi(self) -> bool:
        return self.count > 1

    def endpoint(self) -> tuple[str, int]:
        """`master` as (host, port); `PreflightError` when it is not HOST:PORT."""
        host, sep, port = (self.master or "").rpartition(":")
        ok = sep and host and ":" not in host and port.isdigit() and 1 <= int(port) <= 65535
        if not ok:
            raise PreflightError(
                f"--master {self.master!r} is not HOST:PORT (a port 1-65535; a hostname or "
                "IPv4 address, as Paddle's launcher reads it): give node 0's address and a free "
                "port, the same on every node, e.g. --master 10.0.0.1:29500"
            )
        return host, int(port)

    def log_dir(self, output_dir: str | Path) -> Path:
        """`<output_dir>/logs`, or `logs/node<R>` when several nodes share the directory."""
        logs = Path(output_dir) / "logs"
        return logs / f"node{self.rank}" if self.multi else logs


def launch_command(
    config: str | Path,
    overrides: Sequence[str],
    nproc: int,
    log_dir: Path,
    master_port: int | None = None,
    nodes: Nodes | None = None,
) -> list[str]:
    """The `python -m paddle.distributed.launch ...` command for a job (`nproc` processes on
    this node; with `nodes.multi`, node `nodes.rank` of `nodes.count`)."""
    master = ["--master", f"127.0.0.1:{master_port}"] if master_port else []
    if nodes is not None and nodes.master:
        master = ["--master", nodes.master]
    if nodes is not None and nodes.multi:
        master = ["--nnodes", str(nodes.count), "--rank", str(nodes.rank), *master]
    return [
        sys.executable, "-m", "paddle.distributed.launch",
        "--nproc_per_node", str(nproc),
        "--log_dir", str(log_dir),
        *master,
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


# -- preflight --------------------------------------------------------------------------------


class PreflightError(RuntimeError):
    """The job cannot start; the message names the problem and the fix."""


def master_port(environ: Mapping[str, str] | None = None) -> int | None:
    """`FLASHCP_MASTER_PORT` as a port number that is free on 127.0.0.1 (None when unset)."""
    raw = (os.environ if environ is None else environ).get(ENV_MASTER_PORT, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise PreflightError(
            f"{ENV_MASTER_PORT}={raw!r} is not a port number (1-65535): set a free port or "
            "unset it to let the launcher choose"
        )
    port = int(raw)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"failed: {exc}"
            raise PreflightError(
                f"{ENV_MASTER_PORT}={port}: binding 127.0.0.1:{port} {why} (another job or "
                f"service holds it): pick a free port or unset {ENV_MASTER_PORT} to let the "
                "launcher choose"
            ) from None
    return port


def launcher_ports(environ: Mapping[str, str], nproc: int) -> PortLease | None:
    """Lease the ports Paddle's launcher will pick (its store and endpoints: `nproc` + 1, one
    spare) for the job's lifetime; its `env()` (`PORT_RANGE`) points the launcher at them.
    None when the user set PORT_RANGE. The lease keeps them outside the ephemeral range and
    away from other jobs (`flashcp.distributed.ports`: a port taken before rank 0 binds it
    aborts the job inside Paddle)."""
    if environ.get("PORT_RANGE"):
        return None
    from flashcp.distributed.ports import reserve

    try:
        return reserve(nproc + 2)
    except RuntimeError as exc:
        raise PreflightError(str(exc)) from None


def check_master(nodes: Nodes, *, timeout: float | None = None) -> None:
    """Node 0: the `--master` port, if on this machine, is free for its launcher to serve.
    Other nodes: wait (up to `FLASHCP_INIT_TIMEOUT`) until node 0's launcher serves it, so
    node 0 has done its own checks (and moved an earlier run aside) before they start."""
    from flashcp.distributed.groups import wait_for_port
    from flashcp.distributed.watchdog import resolve_timeout

    host, port = nodes.endpoint()
    if nodes.rank == 0:
        if host in _local_hosts():
            _check_free(host, port, f"--master {nodes.master}",
                        "pick a free port (the same on every node)")  # fmt: skip
        return
    seconds = resolve_timeout(timeout, init=True)
    try:
        wait_for_port(host, port, seconds, what=f"node 0's launcher (--master {nodes.master})")
    except TimeoutError as exc:
        raise PreflightError(
            f"node {nodes.rank}: {exc}: start node 0 first (`flashcp train CONFIG --nnodes "
            f"{nodes.count} --node-rank 0 --master {nodes.master}`), check the address and the "
            "firewall; FLASHCP_INIT_TIMEOUT sets how long to wait"
        ) from None


def _local_hosts() -> set[str]:
    """Names and addresses of this machine (where a --master host would be served here)."""
    names = {"127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()}
    with contextlib.suppress(OSError):
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return names


def _check_free(host: str, port: int, what: str, fix: str) -> None:
    """`PreflightError` naming `what` when `host:port` cannot be bound here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0" if host not in ("127.0.0.1", "localhost") else host, port))
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"failed: {exc}"
            raise PreflightError(
                f"{what}: binding port {port} {why} (another job or service holds it): {fix}"
            ) from None


def check_output_dir(output_dir: str | Path, log_dir: Path | None = None) -> Path:
    """Create the log directory (`<output_dir>/logs` unless `log_dir`) and prove a file can be
    written there; returns the log dir."""
    out = Path(output_dir)
    logs = log_dir or out / "logs"
    probe = logs / f".flashcp-write-test-{os.getpid()}"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise PreflightError(
            f"run.output_dir {out} is not a writable directory: {exc.strerror or exc}{where}; "
            "set run.output_dir to a directory you can write"
        ) from None
    return logs


def check_run_dir(output_dir: str | Path, *, resume: str, overwrite: bool) -> None:
    """A fresh run (`resume` never) may not start over checkpoints, nor a run from step 0 over
    an earlier run's metrics, unless `overwrite` (then `_move_aside` moves the earlier run away
    after every other check has passed)."""
    if overwrite:
        return
    if (problem := rundir.fresh_start_conflict(output_dir, resume)) is not None:
        raise PreflightError(problem)


def check_dispatch(config: str | Path, overrides: Sequence[str]) -> None:
    """The FlashAttention version the workers will resolve: env flags parse, FA4 policy holds."""
    from flashcp import dispatch
    from flashcp.config import load_config

    cfg = load_config(config, overrides)
    try:
        inputs = dispatch.probe_inputs(
            policy=cfg.attention.fa4_unavailable, deterministic=cfg.train.deterministic
        )
        # FA3/FA4 availability on this card included (`dispatch.probe_inputs`).
        dispatch.explain_inputs(inputs, int(cfg.model.head_size))
    except (ValueError, NotImplementedError) as exc:
        raise PreflightError(f"FlashAttention dispatch: {exc}") from None


def check_memory(config: str | Path, overrides: Sequence[str]) -> None:
    """The memory plan fits `hardware.memory_gib` (`flashcp.plan`; no check when it is null)."""
    from flashcp.config import load_config

    cfg = load_config(config, overrides, allow_placeholders=True)
    if cfg.hardware.memory_gib is None:
        return
    from flashcp.plan import plan
    from flashcp.plan.report import refusal

    message = refusal(cfg, plan(cfg))
    if message is not None:
        raise PreflightError(
            f"{message}; or set hardware.memory_gib=null to launch without the memory check"
        )


def _move_aside(output_dir: str | Path) -> Path | None:
    """`rundir.move_aside`, its refusals (checked before anything moves) as `PreflightError`."""
    try:
        return rundir.move_aside(output_dir)
    except rundir.RunDirError as exc:
        raise PreflightError(str(exc)) from None


# -- failure diagnosis ------------------------------------------------------------------------

_CONTAINER = re.compile(r"Container rank (\d+) status \w+ .*? code (-?\d+) log ")
_WATCHDOG = re.compile(r"^\[flashcp\] .* timed out after .*$", re.M)
_FATAL = re.compile(r"\*\*\* (SIG[A-Z]+) \(@0x[0-9a-f]+\) received by PID")
_ABORT = re.compile(r"^.*(?:Assertion .* failed|terminate called|core dumped).*$", re.M)
_PEER_LOST = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Socket closed|"
    r"Connection refused|ECONNRESET|EPIPE|TIMEOUT self_rank = \d+ pair_rank",
    re.I,
)
_ERROR = re.compile(
    r"^(\[rank \d+\] error: .*|(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b: .+)$", re.M
)
_PY_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.M)
_RANK_TAG = re.compile(r"\[rank \d+\] ")
_LAUNCHER_FAILED = "Container failed !!!"
"""After this line the launcher re-prints the failed rank's log tail (`failure_report` says it)."""
# Most telling first: the rank to blame for a failed job.
_SEVERITY = ("killed", "signal", "error", "timeout", "peer", "stopped", "finished", "unknown")


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of a failed job ended, as its log and the launcher tell it."""

    rank: int
    kind: str
    """One of `_SEVERITY`: killed (no word: SIGKILL, OOM), signal (fatal signal), error (own
    non-zero exit), timeout (watchdog), peer (lost a peer), stopped (by the launcher), finished
    (exit 0), unknown (no log)."""
    text: str
    """The sentence that explains it."""


def _signal_name(code: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def classify_rank(rank: int, log: str | None, launcher_code: int | None = None) -> RankOutcome:
    """What `log` (this launch's part of `workerlog.<rank>`) says about how the rank ended.

    `launcher_code` is the rank's exit code when the launcher reported it (negative: signal).
    """
    if log is None:
        return RankOutcome(rank, "unknown", "wrote no log")
    exits = EXIT_LINE.findall(log)
    code = int(exits[-1][1]) if exits else None
    fatal = [name for name in _FATAL.findall(log) if name != "SIGTERM"]
    abort = _ABORT.search(log)
    if fatal or abort:
        what = f"crashed with {fatal[-1]}" if fatal else f"aborted ({abort.group(0).strip()})"
        when = " after finishing its work (at exit)" if code == 0 else ""
        return RankOutcome(rank, "signal", what + when)
    if code is None and (timeout := _WATCHDOG.findall(log)):
        return RankOutcome(rank, "timeout", f"was ended by the watchdog: {timeout[-1].strip()}")
    if code == 0:
        return RankOutcome(rank, "finished", "finished (exit 0)")
    tracebacks = [m.start() for m in _PY_TRACEBACK.finditer(log)]
    if code is not None or tracebacks:
        # The exception line that ends the last Python traceback, else the rank's last error.
        failure = log[tracebacks[-1] :] if tracebacks else log
        errors = _ERROR.findall(failure)
        last_error = (errors[0] if tracebacks else errors[-1]).strip() if errors else ""
        if lost := _PEER_LOST.search(failure):
            start = failure.rfind("\n", 0, lost.start()) + 1
            end = failure.find("\n", lost.end())
            line = failure[start : end if end >= 0 else None].strip()
            return RankOutcome(rank, "peer", f"lost its connection to a peer ({line})")
        what = f"exited with code {code}" if code is not None else "raised an exception"
        return RankOutcome(rank, "error", what + (f": {last_error}" if last_error else ""))
    if _FATAL.search(log):  # SIGTERM, and nothing of its own before it
        return RankOutcome(rank, "stopped", "was stopped by the launcher (SIGTERM)")
    if launcher_code is not None and launcher_code > 0:
        return RankOutcome(rank, "error", f"exited with code {launcher_code} without an error")
    how = (
        f"the launcher saw exit code {launcher_code}: {_signal_name(launcher_code)}"
        if launcher_code is not None and launcher_code < 0
        else "killed from outside: SIGKILL or the out-of-memory killer?"
    )
    return RankOutcome(rank, "killed", f"died without writing an error ({how})")


def launcher_codes(launcher_output: str) -> dict[int, int]:
    """Exit codes of failed ranks reported by the launcher (`Container rank N ... code C`)."""
    return {int(r): int(c) for r, c in _CONTAINER.findall(launcher_output)}


def diagnose(logs: Mapping[int, str | None], launcher_output: str = "") -> list[RankOutcome]:
    """Every rank's outcome, the rank to blame first (then by rank)."""
    codes = launcher_codes(launcher_output)
    outcomes = [classify_rank(r, logs[r], codes.get(r)) for r in sorted(logs)]
    return sorted(outcomes, key=lambda o: (_SEVERITY.index(o.kind), o.rank))


def _tail(text: str, lines: int) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-lines:]


def failure_report(
    code: int,
    logs: Mapping[int, str | None],
    launcher_output: str,
    log_dir: Path,
    rank_offset: int = 0,
) -> str:
    """The text printed after a failed job: the rank to blame, the others, its last lines.

    `logs` are keyed by this node's local process index (`workerlog.<i>`, as the launcher
    reports them); the report names job ranks, `rank_offset` + i (node R of a multi-node job:
    R × processes per node)."""
    outcomes = diagnose(logs, launcher_output)
    if not outcomes:
        return f"flashcp: the job failed (exit {code})"
    first = outcomes[0]
    head = first.rank + rank_offset
    lines = [f"flashcp: the job failed (exit {code}): rank {head} {first.text}"]
    for other in outcomes[1:]:
        same = _RANK_TAG.sub("", other.text) == _RANK_TAG.sub("", first.text)
        lines.append(
            f"flashcp:   rank {other.rank + rank_offset} " + ("the same" if same else other.text)
        )
    log = logs.get(first.rank)
    if log and (first.rank != 0 or first.kind == "killed"):  # local rank 0's log was streamed
        lines.append(f"flashcp: last lines of rank {head}'s log "
                     f"({log_dir / f'workerlog.{first.rank}'}):")  # fmt: skip
        lines += [f"    {line}" for line in _tail(log, TAIL_LINES)]
    return "\n".join(lines)


def rendezvous_timeout() -> float:
    """How long (s) the launchers of a multi-node job may wait for each other: the init
    timeout (`FLASHCP_INIT_TIMEOUT`, default 300 s)."""
    from flashcp.distributed.watchdog import resolve_timeout

    return resolve_timeout(init=True)


def workers_started(marker: str) -> bool:
    """Whether the launcher of job `marker` has started its training processes (after the
    nodes met), i.e. a process of the job runs `flashcp/train.py`."""
    script = str(train_script()).encode()
    for pid in job_pids(marker):
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


def _log_sizes(log_dir: Path, nproc: int) -> dict[int, int]:
    """Current sizes of the rank logs: the launcher appends, so a run's part starts there."""
    sizes = {}
    for rank in range(nproc):
        path = log_dir / f"workerlog.{rank}"
        sizes[rank] = path.stat().st_size if path.is_file() else 0
    return sizes


def read_rank_logs(log_dir: Path, offsets: Mapping[int, int]) -> dict[int, str | None]:
    """Each rank's log written since `offsets` (None when the rank wrote none)."""
    logs: dict[int, str | None] = {}
    for rank, offset in offsets.items():
        path = log_dir / f"workerlog.{rank}"
        if not path.is_file():
            logs[rank] = None
            continue
        with open(path, "rb") as f:
            f.seek(offset)
            logs[rank] = f.read().decode("utf-8", "replace")
    return logs


def _pump(src: TextIO, log: TextIO, out: TextIO) -> None:
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
            or EXIT_LINE.match(line)
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
    resume: str = "auto",
    overwrite: bool = False,
    out: TextIO | None = None,
    progress: bool | None = None,
    nodes: Nodes | None = None,
) -> int:
    """Launch the job, stream rank 0, return its exit code (130 after Ctrl-C, 143 SIGTERM).

    `resume` and `overwrite` are the config's `checkpoint.resume` and `run.overwrite`. `nproc`
    is the job's process count; with `nodes` (several), this node launches its share and joins
    the others at `nodes.master` (node 0 alone moves an earlier run aside)."""
    out = out or sys.stdout
    nodes = nodes or Nodes()
    local = nproc // nodes.count
    lease: PortLease | None = None
    try:
        check_dispatch(config, overrides)
        check_memory(config, overrides)
        port = master_port() if nodes.master is None else None
        lease = launcher_ports(os.environ, local)
        if nodes.master is not None:
            check_master(nodes)
        check_run_dir(output_dir, resume=resume, overwrite=overwrite)
        if nodes.rank == 0 and overwrite and (moved := _move_aside(output_dir)) is not None:
            print(f"flashcp: run.overwrite: moved the earlier run in {output_dir} to {moved}",
                  file=out, flush=True)  # fmt: skip
        log_dir = check_output_dir(output_dir, nodes.log_dir(output_dir))
    except PreflightError as exc:
        if lease is not None:
            lease.release()
        print(f"flashcp: cannot launch: {exc}", file=sys.stderr, flush=True)
        return EXIT_PREFLIGHT
    offsets = _log_sizes(log_dir, local)
    marker = uuid.uuid4().hex
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("PADDLE_TRAINER", "PADDLE_MASTER", "MASTER_"))]:
        del env[key]  # never inherit a surrounding job's identity
    env.update({JOB_MARKER: marker, "PYTHONUNBUFFERED": "1"})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
    if progress is None:
        progress = out.isatty() if hasattr(out, "isatty") else False
    env.setdefault("FLASHCP_PROGRESS", "1" if progress else "0")
    if lease is not None:
        env.update(lease.env())
    cmd = launch_command(config, overrides, local, log_dir, port, nodes)
    where = ""
    if nodes.multi:
        first = nodes.rank * local
        where = (f" as node {nodes.rank} of {nodes.count} (ranks {first}-{first + local - 1} of "
                 f"{nproc}, rendezvous {nodes.master})")  # fmt: skip
    print(f"flashcp: launching {local} process(es){where}; logs in {log_dir}", file=out,
          flush=True)  # fmt: skip
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
            deadline = time.monotonic() + rendezvous_timeout() if nodes.multi else None
            while proc.poll() is None and not received:
                time.sleep(0.1)
                if deadline is not None and time.monotonic() > deadline:
                    if workers_started(marker):
                        deadline = None
                    else:
                        lost = rendezvous_lost(nodes)
                        print(f"flashcp: {lost}", file=out, flush=True)
                        stop_job(proc, marker)
                        return EXIT_PREFLIGHT
            if received:
                print(f"\nflashcp: stopping the job (signal {received[0]})", file=out, flush=True)
                stop_job(proc, marker)
            proc.wait()
            pump.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if lease is not None:
            lease.release()
    if received:
        return 128 + received[0]
    code = int(proc.returncode)
    if code != 0:
        launcher_output = (log_dir / "launcher.log").read_text(errors="replace")
        logs = read_rank_logs(log_dir, offsets)
        report = failure_report(code, logs, launcher_output, log_dir, nodes.rank * local)
        print(report, file=out, flush=True)
    return code
