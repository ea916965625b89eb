"""What `flashcp validate`, `flashcp train` and every launched rank check before compute.

One preflight, in two parts. The first needs no launch and is shared by all three
(`preflight_problems`): after the config's own validation (`flashcp.config.load`), this
machine's device and compute dtype (`flashcp.config.device`) and the FlashAttention version
the ranks will resolve under this environment's flags and FA4 policy (`flashcp.dispatch`), the
memory plan against `hardware.memory_gib` per device and `hardware.host_memory_gib` per node
(`flashcp plan`), the model directory's tensor index (`checkpoint.init_from` /
`model.from_pretrained`: every layer the model builds has tensors there), and a sample of the
data (`data.path` and `eval.path`, `DATA_SAMPLE_ROWS` rows read by the recipe's own data class:
its tokenizer, format, chat template and bad-record rules). Every problem is a `Problem`
naming its key and the fix, each fix validated through this same preflight before it is
printed; `flashcp validate` lists them, `flashcp train` and a rank refuse with them (exit code
`EXIT_PREFLIGHT`, 2: bad config), one line per problem.

The second part is `flashcp train`'s launch (`preflight`): no other job holds `run.output_dir`
(`flashcp.runlock`: said first, it is the reason to know), `FLASHCP_MASTER_PORT` (an optional
fixed port for the launcher's master) is free (`master_port`), the launcher's ports can be
leased (`launcher_ports`), the `--master` of a multi-node job is usable (`check_master`), the
run may start in `run.output_dir` (`check_run_dir`: no fresh run over an earlier run's
checkpoints, see `flashcp.runstart`), and `run.output_dir` can be written (`check_output_dir`). A
problem raises `PreflightError` (printed as one line, exit code `EXIT_PREFLIGHT`), with
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
from typing import Any

from flashcp import dispatch, rundir, runlock, runstart
from flashcp.config import Config, collect, to_dict
from flashcp.config import load as config_load
from flashcp.config.device import DeviceError, compute_dtype, resolve_device
from flashcp.config.errors import prune_fixes
from flashcp.config.placeholders import is_placeholder
from flashcp.distributed.groups import wait_for_port
from flashcp.distributed.ports import PortLease
from flashcp.distributed.watchdog import resolve_timeout
from flashcp.launch.outcome import EXIT_CONFIG
from flashcp.launch.supervise import launcher_lease
from flashcp.plan import plan
from flashcp.plan.report import host_refusal, refusal
from flashcp.problems import Problem, ProblemsError, as_fix

EXIT_PREFLIGHT = EXIT_CONFIG
"""`flashcp train`'s exit code when a check refuses the launch."""
DATA_SAMPLE_ROWS = 64
"""Rows of `data.path` (and `eval.path`) the preflight reads, spread over the data."""
DISPATCH_KEY = "FlashAttention dispatch"
"""The key a dispatch refusal is reported under (its message names the flag and the policy)."""
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
        raise _not_writable(out, exc) from None
    return logs


def _not_writable(out: str | Path, exc: OSError) -> PreflightError:
    where = f" ({exc.filename})" if exc.filename else ""
    return PreflightError(
        f"run.output_dir {out} is not a writable directory: {exc.strerror or exc}{where}; "
        "set run.output_dir to a directory you can write"
    )


def take_lock(output_dir: str | Path, holder: runlock.Holder) -> runlock.Held:
    """`runlock.acquire`, its refusal and a directory it cannot write as `PreflightError`."""
    try:
        return runlock.acquire(output_dir, holder)
    except runlock.RunLockError as exc:
        raise PreflightError(str(exc)) from None
    except OSError as exc:
        raise _not_writable(output_dir, exc) from None


def check_lock(output_dir: str | Path) -> None:
    """`runlock.probe` (another job holds `output_dir`) as `PreflightError`."""
    try:
        runlock.probe(output_dir)
    except runlock.RunLockError as exc:
        raise PreflightError(str(exc)) from None


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
        why = runlock.refusal(output_dir, holder, stale_s=runlock.stale_seconds())
        raise PreflightError(f"node {nodes.rank}: {why}")
    raise PreflightError(
        f"node {nodes.rank}: node 0's launcher serves --master {nodes.master} but holds no lock "
        f"on run.output_dir {output_dir} ({runlock.LOCK_FILE}): run.output_dir must be one "
        "directory shared by every node (and node 0 started with the same --master and --nnodes)"
    )


def check_run_dir(output_dir: str | Path, *, resume: str, overwrite: bool) -> None:
    """A fresh run (`resume` never) may not start over checkpoints, nor a run from step 0 over
    an earlier run's metrics, unless `overwrite` (then `move_aside` moves the earlier run away
    after every other check has passed)."""
    if overwrite:
        return
    if (problem := runstart.fresh_start_conflict(output_dir, resume)) is not None:
        raise PreflightError(problem)


def dispatch_refusal(cfg: Config) -> str | None:
    """Why the ranks could not resolve a FlashAttention version for `cfg`'s model under this
    environment's flags and the FA4 policy (`dispatch.resolve_policy`: config > environment >
    error, as every rank resolves it), or None. The head dims are checked against FA4's kernel
    limits; a mask's limits show per call."""
    try:
        inputs = dispatch.probe_inputs(
            policy=dispatch.resolve_policy(cfg.attention.fa4_unavailable),
            deterministic=cfg.train.deterministic,
        )
        head_dim = int(cfg.model.head_size)
        limit = None
        if inputs.requested == 4:
            limit = dispatch.fa4_call_limit(
                mask_shape=None, num_kv_heads=int(cfg.model.num_kv_heads), head_dim=head_dim
            )
        # FA3/FA4 availability on this card included (`dispatch.probe_inputs`).
        dispatch.explain_inputs(inputs, head_dim, fa4_limit=limit)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


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


def memory_problems(cfg: Config, nnodes: int | None = None) -> list[Problem]:
    """The memory plan against `hardware.memory_gib` per device and `hardware.host_memory_gib`
    per node (`flashcp.plan`; no check of a budget that is null)."""
    problems = []
    if (message := memory_refusal(cfg)) is not None:
        problems.append(Problem(
            "hardware.memory_gib",
            f"{message}; or set hardware.memory_gib=null to launch without the memory check",
        ))  # fmt: skip
    if (message := host_memory_refusal(cfg, nnodes)) is not None:
        problems.append(Problem(
            "hardware.host_memory_gib",
            f"{message}; or set hardware.host_memory_gib=null to launch without the host "
            "memory check",
        ))  # fmt: skip
    return problems


def check_memory(cfg: Config, nnodes: int | None = None) -> None:
    """`memory_problems` as a `PreflightError` (the first)."""
    for problem in memory_problems(cfg, nnodes):
        raise PreflightError(problem.message)


def machine_problems(cfg: Config) -> list[Problem]:
    """This machine against `cfg`: a device and compute dtype Paddle runs here
    (`flashcp.config.device`, the rule every rank applies) and the FlashAttention dispatch
    (`dispatch_refusal`)."""
    from flashcp.runtime import gpu_visible

    problems = []
    try:
        compute_dtype(cfg, resolve_device(cfg, gpu_visible()))
    except DeviceError as exc:
        problems.append(exc.error)
    if (message := dispatch_refusal(cfg)) is not None:
        problems.append(Problem(DISPATCH_KEY, message))
    return problems


def model_dir_problems(cfg: Config) -> list[Problem]:
    """The weights the ranks will load (`checkpoint.init_from`, implied by
    `model.from_pretrained`): their index holds every layer the model builds
    (`flashcp.models.hf_check.index_problems`; no tensor is read)."""
    path = cfg.checkpoint.init_from
    if path is None or is_placeholder(path):
        return []
    from flashcp.models.hf_check import index_problems

    key = "model.from_pretrained" if cfg.model_from_pretrained else "checkpoint.init_from"
    try:
        found = index_problems(path, cfg.model)
    except (OSError, ValueError) as exc:
        return [Problem(key, _one_line(str(exc)))]
    return [
        Problem(
            key if name == "checkpoint.init_from" else name, problem, (as_fix(fix),) if fix else ()
        )  # fmt: skip
        for name, problem, fix in found
    ]


def data_problems(cfg: Config, warnings: list[str] | None = None) -> list[Problem]:
    """A sample of `data.path` and `eval.path` (`DATA_SAMPLE_ROWS` rows, spread over each, each
    read once) read by the recipe's own data class as a rank reads it: a format the recipe
    reads (`flashcp.data.formats.check_data`: else the fields found, the formats accepted and
    the setting that would read them), tokenizer, chat template, bad-record policy, no usable
    record. Placeholders are left to the config's check. Bad records the sample held (which
    training skips, `data.on_bad_record: skip`) go to `warnings`: how many, and why."""
    from flashcp.recipes import recipe_class
    from flashcp.recipes.base import eval_config

    data_class = recipe_class(cfg.run.recipe).data_class
    problems: list[Problem] = []
    sets = [("data.path", cfg.data.path, cfg)]
    if cfg.eval.path is not None:
        sets.append(("eval.path", cfg.eval.path, eval_config(cfg, cfg.eval.path)))
    for key, path, each in sets:
        if path is not None and is_placeholder(path):
            continue
        try:
            data = data_class(each, dp_rank=0, dp_size=1, sample=DATA_SAMPLE_ROWS)
            bad = getattr(data, "bad_records", None)
            if warnings is not None and bad is not None and bad.total:
                reasons = bad.summary().split(": ", 1)[1]
                warnings.append(f"{key}: {bad.total} bad record(s) in a sample of "
                                f"{DATA_SAMPLE_ROWS} rows, which training skips "
                                f"(data.on_bad_record: skip): {reasons}")  # fmt: skip
        except (ValueError, OSError) as exc:
            message = _one_line(str(exc))
            if not any(p.problem == message for p in problems):  # one tokenizer, one message
                problems.append(Problem(key, message))
    return problems


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def static_problems(
    cfg: Config,
    *,
    nnodes: int | None = None,
    machine: bool = True,
    warnings: list[str] | None = None,
) -> list[Problem]:
    """Every check of a loaded (and so validated) `cfg` that needs no compute and no launch:
    this `machine`'s (device, dispatch), the memory plans, the model directory's index, a
    sample of the data (its bad records, which do not refuse, go to `warnings`). Fixes are not
    validated here (`preflight_problems` does)."""
    problems = machine_problems(cfg) if machine else []
    problems += memory_problems(cfg, nnodes)
    problems += model_dir_problems(cfg)
    problems += data_problems(cfg, warnings)
    return problems


def check_raw(
    raw: Mapping[str, Any],
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    nnodes: int = 1,
    machine: bool = True,
    allow_placeholders: bool = False,
) -> tuple[Config | None, list[Problem]]:
    """THE preflight of a config (a file's mapping plus `key=value` overrides, for
    `world_size` processes on `nnodes` nodes): its validation (`flashcp.config.collect`), then,
    when it is valid, `static_problems`. Every problem keeps only the fixes that pass this whole
    preflight once applied (`flashcp.config.errors.prune_fixes`), so no refusal suggests a
    change that would be refused in turn."""
    per_node = nnodes if nnodes > 1 else None

    def run(extra: Sequence[str]) -> tuple[Config | None, list[Problem]]:
        cfg, errors = collect(
            raw, source=source, overrides=[*overrides, *extra], world_size=world_size,
            nnodes=nnodes, allow_placeholders=allow_placeholders, validate_fixes=False,
        )  # fmt: skip
        if errors or cfg is None:
            return cfg, errors
        return cfg, static_problems(cfg, nnodes=per_node, machine=machine, warnings=warnings)

    warnings: list[str] = []
    cfg, problems = run(())
    if cfg is not None and warnings:  # the first run's: shown with the config's own notes
        cfg = dataclasses.replace(cfg, notes=(*cfg.notes, *(f"warning: {w}" for w in warnings)))
    if any(p.fixes for p in problems):
        problems = prune_fixes(problems, lambda extra: run(extra)[1])
    return cfg, problems


def check_config_file(
    path: str | Path, overrides: Sequence[str] = (), **kwargs: Any
) -> tuple[Config | None, list[Problem]]:
    """`check_raw` of the YAML file at `path` (unreadable: `ProblemsError`)."""
    return check_raw(config_load.read_yaml(path), source=str(path), overrides=overrides, **kwargs)


def preflight_problems(
    cfg: Config,
    *,
    world_size: int | None = None,
    nnodes: int = 1,
    machine: bool = True,
    allow_placeholders: bool = False,
) -> list[Problem]:
    """`check_raw` of a loaded `cfg` (from `cfg.source` and `cfg.overrides`, or its resolved
    mapping when built in code): what its launch (`preflight`) refuses."""
    raw = config_load.read_yaml(cfg.source) if cfg.source else to_dict(cfg)
    _, problems = check_raw(
        raw, source=cfg.source, overrides=cfg.overrides, world_size=world_size, nnodes=nnodes,
        machine=machine, allow_placeholders=allow_placeholders,
    )  # fmt: skip
    return problems


def refusal_text(problems: list[Problem], source: str | None) -> str:
    """The problems as printed: one line for one, a heading and one line each for several."""
    return ProblemsError(problems, source).render()


def move_aside(output_dir: str | Path) -> Path | None:
    """`runstart.move_aside`, its refusals (checked before anything moves) as `PreflightError`."""
    try:
        return runstart.move_aside(output_dir)
    except runstart.RunDirError as exc:
        raise PreflightError(str(exc)) from None


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
        if not checked and (problems := preflight_problems(cfg, nnodes=nodes.count)):
            raise PreflightError(refusal_text(problems, cfg.source))
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
