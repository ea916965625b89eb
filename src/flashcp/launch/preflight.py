"""What `flashcp train` and `flashcp eval` check on this machine before they launch.

The config's own preflight (config, device, dispatch, memory plans, model directory, data
sample) is `flashcp.preflight`'s, shared with `flashcp validate` and every rank; `preflight`
runs it unless the caller has (`checked`). Then the launch's checks: no other job holds
`run.output_dir` (`flashcp.runlock`: said first, it is the reason to know),
`FLASHCP_MASTER_PORT` (an optional fixed port for the launcher's master) is free
(`master_port`), the launcher's ports can be leased (`launcher_ports`), the `--master` of a
multi-node job is usable (`check_master`), the run may start in `run.output_dir`
(`check_run_dir`: no fresh run over an earlier run's checkpoints, see `flashcp.runstart`), and
`run.output_dir` can be written (`check_output_dir`). A problem raises `PreflightError` (printed
as one line, exit code `EXIT_PREFLIGHT`), with
nothing launched and nothing written or moved. Only then, with `run.overwrite: true`, node 0
moves an earlier run aside (`runstart.move_aside`, holding its lock meanwhile), the last check
creates the log directory, and the job takes `run.output_dir`'s lock for its whole life
(`Prepared.lock`; a lock left by a job that is gone is taken over, said through `say`).

More than one node (`Nodes`): node 0 checks the master port is free (its launcher serves the
rendezvous there), alone moves an earlier run aside and takes the run directory's lock for the
job; the other nodes first wait for that port (`check_master`, `FLASHCP_INIT_TIMEOUT`), so node 0
has done its checks before they start, then check that node 0 of their job (the same
`--master` and node count) holds the lock (`job_lock`), and each takes its own node's
(`logs/node<R>`: one process per node of a job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashcp import rundir, runlock, runstart
from flashcp.config import Config
from flashcp.distributed.groups import wait_for_port
from flashcp.distributed.ports import PortLease
from flashcp.distributed.watchdog import resolve_timeout
from flashcp.launch.outcome import EXIT_CONFIG
from flashcp.launch.supervise import launcher_lease
from flashcp.preflight import preflight_problems
from flashcp.problems import Problem, ProblemsError

EXIT_PREFLIGHT = EXIT_CONFIG
"""`flashcp train`'s exit code when a check refuses the launch."""
ENV_MASTER_PORT = "FLASHCP_MASTER_PORT"
"""A fixed port for the launcher's master (default: the launcher picks a free one)."""


class PreflightError(ProblemsError, RuntimeError):
    """The job cannot start: its problems (`flashcp.problems.Problem`), each keyed by what it is
    about (a flag such as `--master`, an environment variable such as `FLASHCP_MASTER_PORT`,
    `run.output_dir`) with the way out. Printed after the launcher's "cannot launch: " as
    `key: message` (no "config problem" heading: `kind` is empty), or with the config's
    heading when the config's own preflight refused (`kind="config problem"`)."""

    kind = ""

    def __init__(
        self,
        problems: Problem | Sequence[Problem],
        source: str | None = None,
        *,
        kind: str | None = None,
    ) -> None:
        super().__init__([problems] if isinstance(problems, Problem) else problems, source,
                         kind=kind)  # fmt: skip


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
            raise PreflightError(Problem(
                "--master", f"{self.master!r} is not HOST:PORT (a port 1-65535; a hostname or "
                "IPv4 address, as Paddle's launcher reads it)",
                other="give node 0's address and a free port, the same on every node, e.g. "
                "--master 10.0.0.1:29500",
            ))  # fmt: skip
        return host, int(port)

    def log_dir(self, output_dir: str | Path) -> Path:
        """`<output_dir>/logs`, or `logs/node<R>` when several nodes share the directory."""
        logs = Path(output_dir) / rundir.LOG_DIR
        return logs / f"node{self.rank}" if self.multi else logs


@dataclass
class Prepared:
    """What a passed preflight hands the launch: where the logs go, the master port, the
    port lease and the run directory's lock (the caller releases both when the job ends), and
    the job's lock token (`runlock.ENV_TOKEN`, for its ranks)."""

    log_dir: Path
    master_port: int | None
    lease: PortLease | None
    lock: runlock.Held | None = None
    token: str | None = None

    def release(self) -> None:
        """Release the port lease and the lock (idempotent)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def master_port(environ: Mapping[str, str] | None = None) -> int | None:
    """`FLASHCP_MASTER_PORT` as a port number that is free on 127.0.0.1 (None when unset)."""
    raw = (os.environ if environ is None else environ).get(ENV_MASTER_PORT, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise PreflightError(Problem(
            ENV_MASTER_PORT, f"{raw!r} is not a port number (1-65535)",
            other="set a free port or unset it to let the launcher choose",
        ))  # fmt: skip
    port = int(raw)
    _check_free("127.0.0.1", port, ENV_MASTER_PORT,
                f"pick a free port or unset {ENV_MASTER_PORT} to let the launcher choose",
                where=f"127.0.0.1:{port}")  # fmt: skip
    return port


def launcher_ports(environ: Mapping[str, str], nproc: int) -> PortLease | None:
    """`supervise.launcher_lease`, a machine out of ports as `PreflightError` (keyed
    `PORT_RANGE`, the variable that names the launcher's ports; its message says the way out)."""
    try:
        return launcher_lease(environ, nproc)
    except RuntimeError as exc:
        raise PreflightError(Problem("PORT_RANGE", str(exc))) from None


def check_master(nodes: Nodes, *, timeout: float | None = None) -> None:
    """Node 0: the `--master` port, if on this machine, is free for its launcher to serve.
    Other nodes: wait (up to `FLASHCP_INIT_TIMEOUT`) until node 0's launcher serves it, so
    node 0 has done its own checks (and moved an earlier run aside) before they start."""
    host, port = nodes.endpoint()
    if nodes.rank == 0:
        if host in _local_hosts():
            bind = "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host
            _check_free(bind, port, "--master", "pick a free port (the same on every node)",
                        where=nodes.master)  # fmt: skip
        return
    seconds = resolve_timeout(timeout, init=True)
    try:
        wait_for_port(host, port, seconds, what=f"node 0's launcher (--master {nodes.master})")
    except TimeoutError as exc:
        raise PreflightError(Problem(
            "--master", f"node {nodes.rank}: {exc}",
            other=f"start node 0 first (`flashcp train CONFIG --nnodes {nodes.count} "
            f"--node-rank 0 --master {nodes.master}`), check the address and the firewall; "
            "FLASHCP_INIT_TIMEOUT sets how long to wait",
        )) from None  # fmt: skip


def _local_hosts() -> set[str]:
    """Names and addresses of this machine (where a --master host would be served here)."""
    names = {"127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()}
    with contextlib.suppress(OSError):
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return names


def _check_free(host: str, port: int, key: str, fix: str, *, where: str | None = None) -> None:
    """`PreflightError` keyed `key` (the flag or variable that named the port) when
    `host:port` cannot be bound here; `where`: the address as the user gave it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"failed: {exc}"
            raise PreflightError(Problem(
                key, f"binding {where or f'port {port}'} {why} (another job or service holds "
                "it)", other=fix,
            )) from None  # fmt: skip


def check_output_dir(output_dir: str | Path, log_dir: Path | None = None) -> Path:
    """Create the log directory (`<output_dir>/logs` unless `log_dir`) and prove a file can be
    written there; returns the log dir."""
    out = Path(output_dir)
    logs = log_dir or out / rundir.LOG_DIR
    probe = logs / f".flashcp-write-test-{os.getpid()}"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise _not_writable(out, exc) from None
    return logs


def _not_writable(out: str | Path, exc: OSError) -> PreflightError:
    """`run.output_dir` (`out`) cannot be written, as `PreflightError`."""
    where = f" ({exc.filename})" if exc.filename else ""
    return PreflightError(Problem(
        runlock.OUTPUT_DIR, f"{out} is not a writable directory: {exc.strerror or exc}{where}",
        other="set run.output_dir to a directory you can write",
    ))  # fmt: skip


def take_lock(output_dir: str | Path, holder: runlock.Holder) -> runlock.Held:
    """`runlock.acquire`, its refusal and a directory it cannot write as `PreflightError`."""
    try:
        return runlock.acquire(output_dir, holder)
    except runlock.RunLockError as exc:
        raise PreflightError(exc.problems) from None
    except OSError as exc:
        raise _not_writable(output_dir, exc) from None


def check_lock(output_dir: str | Path) -> None:
    """`runlock.probe` (another job holds `output_dir`) as `PreflightError`."""
    try:
        runlock.probe(output_dir)
    except runlock.RunLockError as exc:
        raise PreflightError(exc.problems) from None


def job_lock(output_dir: str | Path, nodes: Nodes) -> runlock.Holder:
    """Node R > 0: the holder of `output_dir`'s lock, which must be node 0 of this job (the
    same `--master` and node count), running."""
    holder, live = runlock.read_holder(output_dir)
    ours = live and holder is not None and (holder.master, holder.nnodes) == (
        nodes.master, nodes.count
    )  # fmt: skip
    if holder is not None and ours:
        return holder
    if live and holder is not None:
        held = runlock.lock_problem(output_dir, holder, stale_s=runlock.stale_seconds())
        seen = f"node {nodes.rank}: {held.problem}"
        raise PreflightError(dataclasses.replace(held, problem=seen))
    raise PreflightError(Problem(
        runlock.OUTPUT_DIR, f"node {nodes.rank}: node 0's launcher serves --master "
        f"{nodes.master} but holds no lock on {output_dir} ({runlock.LOCK_FILE})",
        other="run.output_dir must be one directory shared by every node (and node 0 started "
        "with the same --master and --nnodes)",
    ))  # fmt: skip


def check_run_dir(output_dir: str | Path, *, resume: str, overwrite: bool) -> None:
    """A fresh run (`resume` never) may not start over checkpoints, nor a run from step 0 over
    an earlier run's metrics, unless `overwrite` (then `move_aside` moves the earlier run away
    after every other check has passed)."""
    if overwrite:
        return
    if problems := runstart.fresh_start_problems(output_dir, resume):
        raise PreflightError(problems)


def move_aside(output_dir: str | Path) -> Path | None:
    """`runstart.move_aside`, its refusals (checked before anything moves) as `PreflightError`."""
    try:
        return runstart.move_aside(output_dir)
    except runstart.RunDirError as exc:
        raise PreflightError(exc.problems) from None


def _overwrite(output_dir: str | Path, holder: runlock.Holder) -> Path | None:
    """`run.overwrite` on node 0: move the earlier run aside while holding its lock (a run
    directory another job holds is never moved)."""
    if not runstart.earlier_run(output_dir) and not (Path(output_dir) / rundir.LOG_DIR).exists():
        return None
    held = take_lock(output_dir, holder)
    moved = None
    try:
        moved = move_aside(output_dir)
    finally:
        held.release(moved_to=moved)
    return moved


def preflight(
    cfg: Config,
    nodes: Nodes,
    *,
    environ: Mapping[str, str] | None = None,
    say: Callable[[str], None] = print,
    evaluating: bool = False,
    checked: bool = False,
    command: str = "",
) -> Prepared:
    """Every check, in order, for this node's share of the job (`preflight_problems`, unless
    `checked`: the caller ran `check_config_file`; then the launch's own); then node 0 moves
    an earlier run aside (`run.overwrite`, told through `say`), the log directory is created
    and the run directory's lock taken (node 0: the job's, naming `command`; the other nodes:
    their node's, once node 0 of their job holds the job's). Raises `PreflightError` with
    nothing launched, written or moved (no lease or lock held). `evaluating` (`flashcp
    eval`): no run directory check and nothing moved (an evaluation writes no checkpoint or
    metrics), logs in `<run.output_dir>/logs/eval`; it takes the lock all the same (it writes
    its results there)."""
    environ = os.environ if environ is None else environ
    output_dir = cfg.run.output_dir
    ready = Prepared(log_dir=Path(output_dir), master_port=None, lease=None)
    holder = runlock.Holder(
        "flashcp eval" if evaluating else "flashcp train", os.getpid(), command=command,
        master=nodes.master if nodes.multi else None, nnodes=nodes.count,
    )  # fmt: skip
    try:
        if not checked and (problems := preflight_problems(cfg, nnodes=nodes.count,
                                                           evaluating=evaluating)):
            raise PreflightError(problems, cfg.source, kind=ProblemsError.kind)
        if nodes.rank == 0:
            check_lock(output_dir)
        ready.master_port = master_port(environ) if nodes.master is None else None
        ready.lease = launcher_ports(environ, cfg.parallel.world_size // nodes.count)
        if nodes.master is not None:
            check_master(nodes)
        job = job_lock(output_dir, nodes) if nodes.rank > 0 else None
        logs = nodes.log_dir(output_dir)
        if evaluating:
            logs = logs / rundir.EVAL_LOG_DIR
        else:
            check_run_dir(output_dir, resume=cfg.checkpoint.resume, overwrite=cfg.run.overwrite)
            if nodes.rank == 0 and cfg.run.overwrite and (moved := _overwrite(output_dir, holder)):
                say(f"flashcp: run.overwrite: moved the earlier run in {output_dir} to {moved}")
        ready.log_dir = check_output_dir(output_dir, logs)
        if job is None:  # node 0: the job's lock
            ready.lock = take_lock(output_dir, holder)
            ready.token = ready.lock.token
        else:  # another node: its node's lock, under the job's
            node = runlock.Holder(f"{holder.what} node {nodes.rank}", os.getpid(),
                                  command=command, master=nodes.master,
                                  nnodes=nodes.count)  # fmt: skip
            ready.lock = take_lock(nodes.log_dir(output_dir), node)
            ready.token = job.token
        if ready.lock.note:
            say(f"flashcp: {ready.lock.note}")
    except PreflightError:
        ready.release()
        raise
    return ready
