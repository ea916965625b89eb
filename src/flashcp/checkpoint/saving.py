"""How a checkpoint is saved by every rank of a job: the host snapshot, the writer (inline, or
in the background with `checkpoint.async`), the agreement, the commit, and a failed save.

A save of step N runs in four phases; only the third may leave the training thread:

1. **Begin** (step boundary, collective): rank 0 makes an empty `step_N.tmp/` (a stale one
   removed) and the ranks gather its outcome — the barrier before anyone writes.
2. **Snapshot** (step boundary): each rank copies the arrays of the files it writes to host
   memory (`flashcp.device.host_array`: one copy, pinned on a GPU); rank 0 also takes the
   trainer state. A synchronous save copies one file at a time, each written before the next
   is copied (the host holds the largest file, as the host plan counts it); an asynchronous
   one copies them all here, and from then on training may change the model: the copies are
   the checkpoint (the host plan counts them all, during the training step).
3. **Write** (`write_part`): each rank writes its files into `step_N.tmp/`, fsyncs them and
   records each one's size and sha256 (`PartReport`). A synchronous save writes here and now;
   an asynchronous one hands the snapshot to a background thread (`Writer`) and training goes
   on. The writer thread makes no collective call and touches no Paddle object: it writes
   numpy arrays (safetensors releases the GIL while it writes) and files, so it can never
   interleave with the training thread's collectives.
4. **Agreement and commit** (a step boundary, collective): the ranks gather their
   `PartReport`s. Only when every rank wrote its whole part does rank 0 write the trainer
   state and the manifest — listing every rank's files with the checksums their writers
   computed — and rename the directory to `step_N/` (`flashcp.checkpoint.format.publish`:
   manifest last, rename atomic); a second gather tells every rank how the commit went. Rank 0
   then prunes to `keep_last` on a background thread (deleting an old checkpoint can take long
   on a parallel filesystem), joined before the next save begins and before the run ends, so
   pruning never overlaps a save's temporary directory. A synchronous save agrees right after
   writing. An asynchronous one is
   settled at the first step boundary at which every rank's writer has finished (each
   boundary while it is in flight, the ranks gather whether their writer is done: one small
   collective), and at the latest when the next save or the end of the run waits for it
   (`Saves.finish`): at most one save is in flight, and that wait is measured.

Every rank takes the same path through these phases, since every decision is made on gathered
data. A save fails as a whole when any rank's part fails (`OSError`: ENOSPC, EACCES, EIO, ...,
or rank 0's begin or commit): every rank logs the causes of all ranks, rank 0 removes
`step_N.tmp/`, and nothing else changes — the newest checkpoint stays the latest, `keep_last`
prunes nothing — and training goes on (the next due save tries again), unless
`checkpoint.fail_on_error`: then every rank raises `SaveError` at the same boundary (exit 4).
Anything but an `OSError` (a bug) fails the save and raises on every rank regardless.

A crash while writing leaves `step_N.tmp/` without a manifest: resume only ever considers
`step_N/` directories whose manifest verifies (`format.latest_checkpoint`), so it takes the
previous checkpoint; the next save of that step empties the directory first, and pruning
removes stale `.tmp` directories.
"""

from __future__ import annotations

import errno
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from flashcp import faults
from flashcp.checkpoint.format import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    CheckpointError,
    file_entry,
    fsync_file,
    list_checkpoints,
    prune_checkpoints,
    publish,
)
from flashcp.checkpoint.parts import begin, tmp_dir

Gather = Callable[[Any], list[Any]]
"""Every rank's value of a small picklable object, in rank order (a collective: every rank
calls it at the same point; `flashcp.distributed.all_gather_object` over the world)."""


class SaveError(CheckpointError):
    """A checkpoint could not be saved (`checkpoint.fail_on_error`, or a bug in the writer);
    the message names every failing rank and its cause."""


@dataclass(frozen=True)
class PartFile:
    """One file a rank writes into the checkpoint: its name relative to the checkpoint
    directory, its arrays (host copies, `flashcp.device.host_array`) and safetensors metadata."""

    name: str
    arrays: Mapping[str, np.ndarray]
    metadata: Mapping[str, str] | None = None

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class Commit:
    """What rank 0 adds at the commit: the trainer state, the manifest's `layout` (None: the
    one-writer layout, `model.safetensors` + `optimizer.safetensors`, no layout entry), the
    files the ranks must have written, and `finish(tmp)`: further files it writes from the
    written parts (a LoRA checkpoint's adapter index and configs), returning their names."""

    state: Mapping[str, Any]
    layout: Mapping[str, Any] | None
    expected: Sequence[str]
    keep_last: int | None
    finish: Callable[[Path], list[str]] | None = None


@dataclass
class Snapshot:
    """One rank's share of checkpoint `step`: the files it writes — produced (copied to host
    memory) as they are iterated, and every rank iterates them to the end, since producing one
    may be a collective (`flashcp.checkpoint.experts`) — and on rank 0 what the commit adds."""

    step: int
    files: Iterable[PartFile]
    commit: Commit | None = None

    def copied(self) -> Snapshot:
        """Every file produced now (the host copies an asynchronous save writes from)."""
        return Snapshot(self.step, list(self.files), self.commit)


@dataclass(frozen=True)
class PartReport:
    """How one rank's part went: its files (name → `{"sha256", "bytes"}`), or the cause it
    failed (`fatal`: not an `OSError`, i.e. a bug), and how long the write took."""

    rank: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    fatal: bool = False
    seconds: float = 0.0


def describe(exc: BaseException) -> str:
    """An error as a log line reads it: `ENOSPC (No space left on device): PATH` for an
    `OSError`, else its type and message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        code = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        where = f": {exc.filename}" if exc.filename else ""
        return f"{code} ({exc.strerror}){where}"
    return f"{type(exc).__name__}: {exc}"


def write_part(tmp: Path, snapshot: Snapshot, rank: int) -> PartReport:
    """Write this rank's files of `snapshot` into `tmp` (each fsynced, then checksummed); never
    raises: a failure is the report's `error`."""
    start = time.perf_counter()
    files: dict[str, dict[str, Any]] = {}
    produced = iter(snapshot.files)
    error, fatal = None, False
    try:
        faults.on_save_write(snapshot.step, tmp, rank)  # no-op unless FLASHCP_FAULT asks
        for part in produced:
            path = tmp / part.name
            path.parent.mkdir(parents=True, exist_ok=True)
            arrays = {k: np.ascontiguousarray(v) for k, v in part.arrays.items()}
            save_file(arrays, str(path), metadata=dict(part.metadata) if part.metadata else None)
            del part, arrays  # the host copy goes before the next file is produced
            fsync_file(path)
            files[path.relative_to(tmp).as_posix()] = file_entry(path)
            faults.on_checkpoint_write(snapshot.step, tmp)  # a torn write, if asked
    except OSError as exc:
        error = describe(exc)
    except Exception as exc:  # a bug: reported to every rank, which all raise
        error, fatal = describe(exc), True
    if error is not None:
        for _ in produced:  # the other ranks' collectives still need this rank's share
            pass
    return PartReport(rank, files, error, fatal, seconds=time.perf_counter() - start)


class Writer:
    """Writes one snapshot at a time on a background thread (`checkpoint.async`)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._report: PartReport | None = None

    @property
    def done(self) -> bool:
        """No write is running (none started, or the last one finished)."""
        return self._thread is None or not self._thread.is_alive()

    def start(self, tmp: Path, snapshot: Snapshot, rank: int) -> None:
        """Write `snapshot` into `tmp` in the background (the previous write must be done)."""
        if not self.done:
            raise RuntimeError("a checkpoint write is still running")
        self._report = None

        def run() -> None:
            self._report = write_part(tmp, snapshot, rank)

        # The thread holds the only reference to the snapshot: its host memory is freed once
        # the write ends. Daemon: a job that fails elsewhere does not wait for it (the
        # half-written directory has no manifest and is never loaded).
        self._thread = threading.Thread(target=run, name=f"flashcp-checkpoint-{snapshot.step}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def wait(self, timeout: float, rank: int) -> PartReport:
        """The running (or last) write's report, waiting up to `timeout` s for it; a write
        still running then is reported as failed (it is left to finish on its own)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return PartReport(rank, error=f"the write did not finish within {timeout:g} s")
        if self._report is None:
            return PartReport(rank, error="no write was started", fatal=True)
        return self._report


def commit(root: Path, step: int, spec: Commit, reports: Sequence[PartReport]) -> Path:
    """Rank 0, once every rank wrote its part: the trainer state, `spec.finish`'s files and the
    manifest (every file with the checksum its writer computed), then the atomic rename
    (`format.publish`; pruning is the caller's). Raises `OSError` (or `SaveError` for a part
    nobody wrote)."""
    tmp = tmp_dir(root, step)
    files: dict[str, dict[str, Any]] = {}
    for report in reports:
        files.update(report.files)
    missing = [name for name in spec.expected if name not in files]
    if missing:
        raise SaveError(f"checkpoint step {step}: no rank wrote {', '.join(missing)}")
    state = tmp / STATE_FILE
    state.write_text(json.dumps({**spec.state, "step": step}, indent=1, sort_keys=True))
    fsync_file(state)
    files[STATE_FILE] = file_entry(state)
    for name in spec.finish(tmp) if spec.finish is not None else []:
        fsync_file(tmp / name)
        files[name] = file_entry(tmp / name)
    extra = {"layout": dict(spec.layout)} if spec.layout is not None else None
    return publish(root, tmp, step, files, keep_last=None, extra=extra)


CLASSIC_FILES: tuple[str, str] = (MODEL_FILE, OPTIMIZER_FILE)
"""The one-writer layout's tensor files (`Commit.expected` of a checkpoint without parts)."""


@dataclass
class SaveReport:
    """What the checkpointer did at one step boundary: metrics for the step's record and lines
    for rank 0 to print."""

    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    saved: list[Path] = field(default_factory=list)
    """Checkpoints committed at this boundary (rank 0; empty elsewhere)."""
    failed: list[int] = field(default_factory=list)
    """Steps whose save failed at this boundary."""

    def merge(self, other: SaveReport) -> SaveReport:
        """Both reports as one (the seconds, `*_s`, added; other metrics `other`'s)."""
        metrics = dict(self.metrics)
        for key, value in other.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value if key.endswith("_s") else value
        return SaveReport(metrics, self.messages + other.messages, self.saved + other.saved,
                          self.failed + other.failed)  # fmt: skip


STALL = "checkpoint/stall_s"
"""Seconds the step boundary spent in the checkpointer (training stood still): on a save step
the whole save (sync) or the wait for the previous save plus the host copy (async); on a step
that settles an asynchronous save, the agreement and the commit."""
WAIT = "checkpoint/wait_s"
"""The part of `STALL` spent waiting for the previous asynchronous save's writers."""
SAVED = "checkpoint/saved_step"
"""The step of a checkpoint committed at this boundary."""
FAILED = "checkpoint/failed_step"
"""The step of a save that failed at this boundary."""


class Saves:
    """One rank's side of the save protocol (module docstring): `save` at a due step boundary,
    `poll` at every other one, `finish` before the run ends. Every method is collective: all
    ranks call it at the same boundary."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        gather: Gather,
        poll_gather: Gather | None = None,
        asynchronous: bool,
        fail_on_error: bool,
        timeout: float,
        echo: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.root = root
        self.rank = rank
        self.gather = gather
        """Gathers where a rank may wait long for another (its writer, rank 0's commit)."""
        self.poll_gather = poll_gather or gather
        """The per-boundary gather of the writers' state (ranks arrive together: the ordinary
        collective timeout)."""
        self.asynchronous = asynchronous
        self.fail_on_error = fail_on_error
        self.timeout = timeout
        """How long a rank waits for its own writer (the gathers wait as long for the others)."""
        self.echo = echo
        """Prints on rank 0 (the trainer's output)."""
        self.warn = warn
        """Logs on this rank (every rank logs a failed save)."""
        self.writer = Writer()
        self.inflight: int | None = None
        """The step of the asynchronous save being written, if any."""
        self._commit: Commit | None = None
        """Rank 0: what the in-flight save's commit adds."""
        self.last_write_s = 0.0
        """How long this rank's last finished write took (the benchmark reads it)."""
        self._pruner: threading.Thread | None = None
        """Rank 0: pruning to `keep_last` after the last commit, in the background."""

    # -- the protocol -----------------------------------------------------------------------

    def save(self, step: int, snapshot: Callable[[], Snapshot]) -> SaveReport:
        """Save checkpoint `step` from `snapshot()` (called on every rank at this boundary):
        wait for and settle the save in flight first, then begin, snapshot, and write — to the
        end (sync) or in the background (`asynchronous`)."""
        start = time.perf_counter()
        report = SaveReport()
        wait = 0.0
        if self.inflight is not None:
            report = report.merge(self._settle(wait=True))
            wait = time.perf_counter() - start
        self._join_pruner()
        causes = self._begin(step)
        if causes:
            report = report.merge(self._failed(step, causes, fatal=False))
        else:
            snap = snapshot()
            self._commit = snap.commit
            self.inflight = step
            tmp = tmp_dir(self.root, step)
            if self.asynchronous:
                self.writer.start(tmp, snap.copied(), self.rank)
            else:
                part = write_part(tmp, snap, self.rank)
                report = report.merge(self._settle(wait=False, part=part))
        report.metrics[STALL] = time.perf_counter() - start
        report.metrics[WAIT] = wait
        return report

    def poll(self) -> SaveReport:
        """At a step boundary without a save: settle the asynchronous save in flight once every
        rank's writer has finished (one small gather while one is in flight, nothing else)."""
        if self.inflight is None:
            return SaveReport()
        start = time.perf_counter()
        report = SaveReport()
        if all(self.poll_gather(self.writer.done)):
            report = self._settle(wait=False)
        report.metrics[STALL] = time.perf_counter() - start
        return report

    def finish(self) -> SaveReport:
        """Wait for the save in flight and settle it, and for the pruning after the last
        commit (before the run ends or stops)."""
        if self.inflight is None and self._pruner is None:
            return SaveReport()
        start = time.perf_counter()
        report = self._settle(wait=True) if self.inflight is not None else SaveReport()
        self._join_pruner()
        report.metrics[STALL] = time.perf_counter() - start
        report.metrics[WAIT] = report.metrics[STALL]
        return report

    # -- phases -----------------------------------------------------------------------------

    def _begin(self, step: int) -> list[str]:
        """Rank 0 empties `step_N.tmp/`; every rank learns whether it could (the causes)."""
        cause = None
        if self.rank == 0:
            try:
                begin(self.root, step)
            except OSError as exc:
                cause = describe(exc)
        outcomes = self.gather(cause)
        return [f"rank 0: {c}" for c in outcomes[:1] if c]

    def _settle(self, *, wait: bool, part: PartReport | None = None) -> SaveReport:
        """The agreement and the commit of the save in flight (module docstring, phase 4)."""
        step, spec = self.inflight, self._commit
        assert step is not None
        self.inflight, self._commit = None, None
        if part is None:
            part = self.writer.wait(self.timeout if wait else 0.0, self.rank)
        self.last_write_s = part.seconds
        reports: list[PartReport] = self.gather(part)
        failed = [r for r in reports if r.error]
        if failed:
            causes = [f"rank {r.rank}: {r.error}" for r in failed]
            return self._failed(step, causes, fatal=any(r.fatal for r in failed))
        path, cause, fatal = None, None, False
        if self.rank == 0:
            assert spec is not None
            try:
                path = commit(self.root, step, spec, reports)
            except OSError as exc:
                cause = describe(exc)
            except Exception as exc:  # a bug: every rank raises
                cause, fatal = describe(exc), True
        outcome = self.gather((cause, fatal))[0]
        if outcome[0] is not None:
            return self._failed(step, [f"rank 0 (commit): {outcome[0]}"], fatal=outcome[1])
        report = SaveReport(metrics={SAVED: float(step)})
        if path is not None:
            assert spec is not None
            self._prune(spec.keep_last)
            report.saved.append(path)
            report.messages.append(f"saved checkpoint {path}")
        return report

    def _prune(self, keep_last: int | None) -> None:
        """Rank 0: delete all but the newest `keep_last` checkpoints (and stale temporary
        directories) in the background."""
        if keep_last is None:
            return
        self._pruner = threading.Thread(target=prune_checkpoints, args=(self.root, keep_last),
                                        name="flashcp-checkpoint-prune", daemon=True)  # fmt: skip
        self._pruner.start()

    def _join_pruner(self) -> None:
        if self._pruner is not None:
            self._pruner.join(self.timeout)
            self._pruner = None

    def _failed(self, step: int, causes: list[str], *, fatal: bool) -> SaveReport:
        """A save that failed on some rank: every rank logs why, rank 0 removes the temporary
        directory; raise (`fail_on_error`, or a bug) or go on."""
        if self.rank == 0:
            shutil.rmtree(tmp_dir(self.root, step), ignore_errors=True)
        saved = list_checkpoints(self.root)
        latest = f"step_{saved[-1][0]}" if saved else None
        text = f"checkpoint step {step} was not saved: {'; '.join(causes)}"
        if fatal or self.fail_on_error:
            raise SaveError(
                f"{text} (the newest checkpoint is {latest or 'none'})"
                + ("" if fatal else "; set checkpoint.fail_on_error=false to train on instead")
            )
        kept = f"The newest checkpoint is still {latest}" if latest else "No checkpoint exists yet"
        line = (
            f"warning: {text}. {kept} (nothing pruned); training continues and the next save "
            "tries again"
        )
        if self.rank == 0:
            self.echo(line)
        else:
            self.warn(f"[rank {self.rank}] {line}")
        return SaveReport(metrics={FAILED: float(step)}, failed=[step])
