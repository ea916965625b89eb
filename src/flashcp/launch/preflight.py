"""What `flashcp train` checks before it launches anything, on the loaded `Config`.

`preflight` runs the checks the config's own validation cannot make, in this order: the
FlashAttention flags in the environment resolve for this model (`check_dispatch`), the memory
plan fits `hardware.memory_gib` per device and `hardware.host_memory_gib` per node
(`check_memory`, `flashcp plan`), `FLASHCP_MASTER_PORT` (an
optional fixed port for the launcher's master) is free (`master_port`), the launcher's ports
can be leased (`launcher_ports`), the `--master` of a multi-node job is usable
(`check_master`), the run may start in `run.output_dir` (`check_run_dir`: no fresh run over an
earlier run's checkpoints, see `flashcp.rundir`), and `run.output_dir` can be written
(`check_output_dir`). A problem raises `PreflightError` (printed as one line, exit code
`EXIT_PREFLIGHT`), with nothing launched and nothing written or moved. Only then, with
`run.overwrite: true`, node 0 moves an earlier run aside (`rundir.move_aside`), and the last
check creates the log directory.

More than one node (`Nodes`): node 0 checks the master port is free (its launcher serves the
rendezvous there) and alone moves an earlier run aside; the other nodes first wait for that
port (`check_master`, `FLASHCP_INIT_TIMEOUT`), so node 0 has done its checks before they start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from flashcp import dispatch, rundir
from flashcp.config import Config
from flashcp.distributed.groups import wait_for_port
from flashcp.distributed.ports import PortLease
from flashcp.distributed.watchdog import resolve_timeout
from flashcp.launch.supervise import launcher_lease
from flashcp.plan import plan
from flashcp.plan.report import host_refusal, refusal

EXIT_PREFLIGHT = 2
"""`flashcp train`'s exit code when a check refuses the launch."""
ENV_MASTER_PORT = "FLASHCP_MASTER_PORT"
"""A fixed port for the launcher's master (default: the launcher picks a free one)."""


class PreflightError(RuntimeError):
    """The job cannot start; the message names the problem and the fix."""


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
        logs = Path(output_dir) / rundir.LOG_DIR
        return logs / f"node{self.rank}" if self.multi else logs


@dataclass
class Prepared:
    """What a passed preflight hands the launch: where the logs go, the master port, the
    port lease (the caller releases it when the job ends)."""

    log_dir: Path
    master_port: int | None
    lease: PortLease | None


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
    _check_free("127.0.0.1", port, f"{ENV_MASTER_PORT}={port}",
                f"pick a free port or unset {ENV_MASTER_PORT} to let the launcher choose",
                where=f"127.0.0.1:{port}")  # fmt: skip
    return port


def launcher_ports(environ: Mapping[str, str], nproc: int) -> PortLease | None:
    """`supervise.launcher_lease`, a machine out of ports as `PreflightError`."""
    try:
        return launcher_lease(environ, nproc)
    except RuntimeError as exc:
        raise PreflightError(str(exc)) from None


def check_master(nodes: Nodes, *, timeout: float | None = None) -> None:
    """Node 0: the `--master` port, if on this machine, is free for its launcher to serve.
    Other nodes: wait (up to `FLASHCP_INIT_TIMEOUT`) until node 0's launcher serves it, so
    node 0 has done its own checks (and moved an earlier run aside) before they start."""
    host, port = nodes.endpoint()
    if nodes.rank == 0:
        if host in _local_hosts():
            bind = "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host
            _check_free(bind, port, f"--master {nodes.master}",
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


def _check_free(host: str, port: int, what: str, fix: str, *, where: str | None = None) -> None:
    """`PreflightError` naming `what` when `host:port` cannot be bound here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"failed: {exc}"
            raise PreflightError(
                f"{what}: binding {where or f'port {port}'} {why} (another job or service "
                f"holds it): {fix}"
            ) from None


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
        where = f" ({exc.filename})" if exc.filename else ""
        raise PreflightError(
            f"run.output_dir {out} is not a writable directory: {exc.strerror or exc}{where}; "
            "set run.output_dir to a directory you can write"
        ) from None
    return logs


def check_run_dir(output_dir: str | Path, *, resume: str, overwrite: bool) -> None:
    """A fresh run (`resume` never) may not start over checkpoints, nor a run from step 0 over
    an earlier run's metrics, unless `overwrite` (then `move_aside` moves the earlier run away
    after every other check has passed)."""
    if overwrite:
        return
    if (problem := rundir.fresh_start_conflict(output_dir, resume)) is not None:
        raise PreflightError(problem)


def check_dispatch(cfg: Config) -> None:
    """The FlashAttention version the workers will resolve: env flags parse, FA4 policy holds."""
    try:
        inputs = dispatch.probe_inputs(
            policy=dispatch.resolve_policy(cfg.attention.fa4_unavailable),
            deterministic=cfg.train.deterministic,
        )
        # FA3/FA4 availability on this card included (`dispatch.probe_inputs`).
        dispatch.explain_inputs(inputs, int(cfg.model.head_size))
    except (ValueError, NotImplementedError) as exc:
        raise PreflightError(f"FlashAttention dispatch: {exc}") from None


def memory_refusal(cfg: Config) -> str | None:
    """The over-budget message of `cfg`'s memory plan (None: it fits, or no
    `hardware.memory_gib` to check against)."""
    if cfg.hardware.memory_gib is None:
        return None
    return refusal(cfg, plan(cfg))


def host_memory_refusal(cfg: Config, nnodes: int | None = None) -> str | None:
    """The over-budget message of `cfg`'s host plan per node (None: it fits, or no
    `hardware.host_memory_gib`); `nnodes`: the launch's nodes (ranks per node = dp·pp·cp /
    nnodes; default `hardware.gpus_per_node`)."""
    if cfg.hardware.host_memory_gib is None:
        return None
    return host_refusal(plan(cfg, nnodes=nnodes))


def check_memory(cfg: Config, nnodes: int | None = None) -> None:
    """The memory plan fits `hardware.memory_gib` per device and `hardware.host_memory_gib`
    per node (`flashcp.plan`; no check of a budget that is null)."""
    if (message := memory_refusal(cfg)) is not None:
        raise PreflightError(
            f"{message}; or set hardware.memory_gib=null to launch without the memory check"
        )
    if (message := host_memory_refusal(cfg, nnodes)) is not None:
        raise PreflightError(
            f"{message}; or set hardware.host_memory_gib=null to launch without the host "
            "memory check"
        )


def move_aside(output_dir: str | Path) -> Path | None:
    """`rundir.move_aside`, its refusals (checked before anything moves) as `PreflightError`."""
    try:
        return rundir.move_aside(output_dir)
    except rundir.RunDirError as exc:
        raise PreflightError(str(exc)) from None


def preflight(
    cfg: Config,
    nodes: Nodes,
    *,
    environ: Mapping[str, str] | None = None,
    say: Callable[[str], None] = print,
) -> Prepared:
    """Every check, in order, for this node's share of the job; then node 0 moves an earlier
    run aside (`run.overwrite`, told through `say`) and the log directory is created.
    Raises `PreflightError` with nothing launched, written or moved (no lease held)."""
    environ = os.environ if environ is None else environ
    output_dir = cfg.run.output_dir
    lease: PortLease | None = None
    try:
        check_dispatch(cfg)
        check_memory(cfg, nodes.count if nodes.multi else None)
        port = master_port(environ) if nodes.master is None else None
        lease = launcher_ports(environ, cfg.parallel.world_size // nodes.count)
        if nodes.master is not None:
            check_master(nodes)
        check_run_dir(output_dir, resume=cfg.checkpoint.resume, overwrite=cfg.run.overwrite)
        if nodes.rank == 0 and cfg.run.overwrite and (moved := move_aside(output_dir)):
            say(f"flashcp: run.overwrite: moved the earlier run in {output_dir} to {moved}")
        log_dir = check_output_dir(output_dir, nodes.log_dir(output_dir))
    except PreflightError:
        if lease is not None:
            lease.release()
        raise
    return Prepared(log_dir=log_dir, master_port=port, lease=lease)
