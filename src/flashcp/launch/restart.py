"""Automatic restarts (`run.max_restarts`): whether a failed launch is relaunched, from which
checkpoint, after how long, and the record of it, `restarts.jsonl` in the run directory.

`flashcp train` (`flashcp.launch.job`) runs the job again when a launch fails in a way a
relaunch can fix — a rank killed or crashed, a hang the collective watchdog ended, a lost
peer or node — and never after an exit code a relaunch cannot change (`outcome.FINAL_CODES`:
a refused config, a non-finite loss, a broken checkpoint, bad data, a pre-emption). Each node
reports how its launch ended (`Report`); `decide` turns every node's report into one
`Decision`, the same on every node (node 0 makes it, `flashcp.launch.nodesync`). A relaunch
resumes from the run's latest complete checkpoint, named explicitly (`relaunch_overrides`):
the ranks verify its checksums, and one that fails them stops the job (exit 4) instead of
silently falling back. The run directory is the run's own on a relaunch (`flashcp.attempt`),
and `run.overwrite` never moves it again.

Why not Paddle's own: `paddle.distributed.launch --max_restart` restarts only in its elastic
controller, which needs an etcd server (`--master etcd://...`); its default controller stops
at the first failed rank. `flashcp train` already supervises the launcher (one process killer,
rank outcomes, `flashcp.launch.supervise`), so it relaunches it, and the nodes of a job agree
through the run directory they share (`flashcp.launch.nodesync`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flashcp.checkpoint.format import list_checkpoints
from flashcp.config import Config
from flashcp.launch.outcome import FINAL_CODES, SEVERITY, Verdict
from flashcp.rundir import CHECKPOINT_DIR, RESTARTS_FILE

BACKOFF_MAX_S = 300.0
"""The longest wait before a relaunch, however many came before."""


def backoff_s(base: float, restart: int) -> float:
    """Seconds to wait before restart number `restart` (1 for the first): `base`, doubled each
    time, at most `BACKOFF_MAX_S`."""
    return float(min(base * 2 ** max(restart - 1, 0), BACKOFF_MAX_S))


@dataclass(frozen=True)
class Report:
    """How one node's launch ended: its exit code and verdict (`outcome.verdict`)."""

    node: int
    code: int
    cause: str
    rank: int | None
    text: str
    at: float
    """Wall clock when its launcher exited."""
    kind: str = "unknown"
    """How its blamed rank ended (`outcome.SEVERITY`): a node whose rank hung is blamed before
    one whose ranks timed out waiting for it."""

    @classmethod
    def of(cls, node: int, v: Verdict, at: float | None = None) -> Report:
        at = time.time() if at is None else at
        return cls(node, v.code, v.cause, v.rank, v.text, at, v.kind)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Report:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Decision:
    """What every node does after a failed launch."""

    restart: bool
    code: int
    """The job's exit code if it stops."""
    cause: str
    node: int | None
    rank: int | None
    text: str
    why: str
    """Why it stops (empty when it restarts)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Decision:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def decide(
    reports: Mapping[int, Report | None], *, restarts: int, max_restarts: int, nodes: int = 1
) -> Decision:
    """One decision from every node's report of a failed launch (None: the node never
    reported, it is lost), after `restarts` restarts of at most `max_restarts`."""
    lost = [n for n in range(nodes) if reports.get(n) is None]
    if lost:
        return Decision(False, 1, "node lost", lost[0], None,
                        f"node {lost[0]} did not report how its launch ended (its `flashcp train` "
                        "is gone)", "a lost node cannot be relaunched from here")  # fmt: skip
    got = [r for r in reports.values() if r is not None]
    failed = [r for r in got if r.code != 0] or got
    final = [r for r in failed if r.code in FINAL_CODES]
    order = {kind: i for i, kind in enumerate(SEVERITY)}
    blamed = min(final or failed, key=lambda r: (order.get(r.kind, len(order)), r.at, r.node))
    base = Decision(True, blamed.code, blamed.cause, blamed.node, blamed.rank, blamed.text, "")
    if final:
        why = f"{FINAL_CODES[blamed.code]} (exit {blamed.code}) is not fixed by a relaunch"
        return Decision(**{**base.to_json(), "restart": False, "why": why})
    if restarts >= max_restarts:
        why = (f"run.max_restarts is {max_restarts}" if max_restarts == 0
               else f"all {max_restarts} restarts (run.max_restarts) are used")  # fmt: skip
        return Decision(**{**base.to_json(), "restart": False, "why": why})
    return base


def latest_complete(output_dir: str | Path) -> tuple[int, Path] | None:
    """The run's newest complete checkpoint, `(step, path)`: a `step_N` directory exists only
    once every part and its manifest are written (`flashcp.checkpoint.format.publish`)."""
    found = list_checkpoints(Path(output_dir) / CHECKPOINT_DIR)
    return found[-1] if found else None


def newest_checkpoint(output_dir: str | Path) -> tuple[int, Path, int] | None:
    """`latest_complete` with its manifest's modification time (ns): a checkpoint of the same
    step written again (after a resume from an older one) is a new one."""
    found = latest_complete(output_dir)
    if found is None:
        return None
    step, path = found
    try:
        stamp = (path / "manifest.json").stat().st_mtime_ns
    except OSError:
        stamp = 0
    return step, path, stamp


def relaunch_overrides(cfg: Config) -> tuple[list[str], int | None]:
    """The overrides a relaunch adds to the command's own, and the step it resumes from (None:
    the start, or the `checkpoint.resume` path the run began from).

    The latest complete checkpoint by name (`checkpoint.resume=PATH`): its checksums are checked
    by the ranks that load it, and a broken one stops the job. `run.overwrite=false`: the run
    directory is this run's."""
    keep = ["run.overwrite=false"]
    found = latest_complete(cfg.run.output_dir)
    if found is None:
        return keep, None
    step, path = found
    return [*keep, f"checkpoint.resume={json.dumps(str(path))}"], step


@dataclass(frozen=True)
class RestartRecord:
    """One line of `restarts.jsonl`."""

    time: str
    """When the relaunch was decided (local time, ISO 8601)."""
    restart: int
    """1 for the run's first restart, and so on (over every `flashcp train` of the run)."""
    cause: str
    """killed, hang, crash, error, peer lost, ... (`outcome.CAUSES`)."""
    rank: int | None
    node: int | None
    exit_code: int
    detail: str
    resume_step: int | None
    """The checkpoint step the relaunch resumes from (None: from the start)."""
    backoff_s: float

    @classmethod
    def of(cls, d: Decision, restart: int, resume_step: int | None, wait: float) -> RestartRecord:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        return cls(stamp, restart, d.cause, d.rank, d.node, d.code, d.text, resume_step, wait)


def append_record(output_dir: str | Path, record: RestartRecord) -> Path:
    """Append `record` to the run's `restarts.jsonl` (flushed and synced: it is the run's
    account of what happened)."""
    path = Path(output_dir) / RESTARTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(asdict(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path
