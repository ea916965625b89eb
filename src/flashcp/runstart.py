"""May a run start in its run directory, and moving an earlier run aside (`run.overwrite`).

What a run writes to `run.output_dir` is named in `flashcp.rundir`. A fresh run (`checkpoint.resume:
never`) in a directory that already holds checkpoints would mix two runs, so it is refused, with the
three ways out (`start_conflict`): continue the run (`checkpoint.resume=auto`), start over in the
same place (`run.overwrite=true`), or write elsewhere (another `run.output_dir`). A run that would
start from step 0 (no checkpoint to continue from, whatever `checkpoint.resume` says) over the
`metrics.jsonl` of an earlier run would truncate it, so it is refused too (`metrics_conflict`), with
the two ways out that apply. `flashcp train` checks this before launching
(`flashcp.launch.preflight`); every rank checks it again, once per process and run, with the
same message, for jobs started by `paddle.distributed.launch` directly: `flashcp.launch.worker`
before building (its `Trainer` is told `start_checked`), or the `Trainer` itself when used
in-process (`Trainer(cfg).fit()`). This module sits below both the trainer and `flashcp.launch`,
which import it.

`run.overwrite: true` never deletes: `flashcp train` renames the directory to
`<output_dir>.old-<YYYYmmdd-HHMMSS>[-N]` (`move_aside`: one rename in the same parent, to a name
reserved with `mkdir` first, so two moves cannot collide) before any process starts, and the job
writes into a fresh directory; a directory another job holds (`flashcp.runlock`) is never moved.
Ranks never move anything (ranks of one job would race, and a
job may span hosts): a rank that finds an earlier run while `run.overwrite` is true refuses and
points at `flashcp train`. A directory holding only `logs/` (what the launcher writes before
the ranks start) and the job's lock (`flashcp.rundir.LOCK_FILE`) is not an earlier run. Ranks
relaunched by an automatic restart (`flashcp.attempt`: attempt > 0) skip the check: what they
find there is their own run's.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from flashcp.attempt import current as current_attempt
from flashcp.checkpoint.format import list_checkpoints
from flashcp.rundir import ASIDE, CHECKPOINT_DIR, LOCK_FILE, LOG_DIR, METRICS_FILE


class RunDirError(RuntimeError):
    """The run cannot start in `run.output_dir`; the message names the ways out."""


def earlier_run(output_dir: str | Path) -> list[str]:
    """Names of what an earlier run left in `output_dir` (all entries but `logs/` and the
    lock), sorted."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name not in (LOG_DIR, LOCK_FILE))


def checkpoint_conflict(output_dir: str | Path, resume: str) -> str | None:
    """The refusal of a fresh run (`resume` never) over checkpoints; None when there is none."""
    if resume != "never":
        return None
    found = list_checkpoints(Path(output_dir) / CHECKPOINT_DIR)
    if not found:
        return None
    return (
        f"run.output_dir {output_dir} already holds checkpoints ({found[-1][1].name}) and "
        "checkpoint.resume is never: set checkpoint.resume=auto to continue that run, "
        "run.overwrite=true to move it aside and start over, or choose another run.output_dir"
    )


def metrics_conflict(output_dir: str | Path, resume: str) -> str | None:
    """The refusal of a run that would start from step 0 over an earlier run's metrics.

    None when `resume` names a checkpoint, when there is a checkpoint to continue from (resume
    `auto`; `never` over checkpoints is `checkpoint_conflict`), or when `metrics.jsonl` is
    missing or empty.
    """
    out = Path(output_dir)
    if resume not in ("never", "auto") or list_checkpoints(out / CHECKPOINT_DIR):
        return None
    metrics = out / METRICS_FILE
    try:
        records = sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        return None
    if not records:
        return None
    return (
        f"run.output_dir {output_dir} holds {METRICS_FILE} of an earlier run ({records} "
        "step record(s)) and no checkpoint to continue from, so this run would start from step "
        f"0 and overwrite it: set run.overwrite=true to move the earlier run aside and start "
        "over, or choose another run.output_dir"
    )


def fresh_start_conflict(output_dir: str | Path, resume: str) -> str | None:
    """`checkpoint_conflict`, else `metrics_conflict`: why a run may not write here."""
    return checkpoint_conflict(output_dir, resume) or metrics_conflict(output_dir, resume)


def holds_cwd(output_dir: str | Path) -> bool:
    """Whether the current directory is `output_dir` or inside it (it cannot be moved away)."""
    out = Path(output_dir).resolve()
    cwd = Path.cwd().resolve()
    return cwd == out or out in cwd.parents


def start_conflict(output_dir: str | Path, resume: str, overwrite: bool) -> str | None:
    """Why a rank cannot start in `output_dir` (None: it can). Ranks never move a run aside."""
    if overwrite:
        found = earlier_run(output_dir)
        if not found:
            return None
        return (
            f"run.overwrite is true and run.output_dir {output_dir} holds an earlier run "
            f"({', '.join(found)}): `flashcp train` moves it aside before launching, the ranks "
            "of a job started by paddle.distributed.launch do not: run `flashcp train CONFIG "
            f"run.overwrite=true`, or move {output_dir} away yourself"
        )
    return fresh_start_conflict(output_dir, resume)


def check_start(output_dir: str | Path, resume: str, overwrite: bool) -> None:
    """Raise `RunDirError` when a run cannot start in `output_dir` (`start_conflict`); never
    in a relaunch of the same run (`flashcp.attempt`)."""
    if current_attempt().relaunch:
        return
    if (problem := start_conflict(output_dir, resume, overwrite)) is not None:
        raise RunDirError(problem)


def aside_path(output_dir: str | Path, when: float | None = None) -> Path:
    """`<output_dir>.old-<YYYYmmdd-HHMMSS>` for local time `when` (default: now)."""
    out = Path(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return out.with_name(f"{out.name}{ASIDE}{stamp}")


def move_aside(output_dir: str | Path, when: float | None = None) -> Path | None:
    """Rename a non-empty `output_dir` to a new `aside_path` and return it (None: nothing to
    move). The target name is reserved with `mkdir` (`-2`, `-3`, ... when taken), then the
    directory is renamed onto that empty placeholder: nothing is copied or deleted."""
    out = Path(output_dir)
    if not out.is_dir() or not any(p.name != LOCK_FILE for p in out.iterdir()):
        return None
    if holds_cwd(out):
        raise RunDirError(
            f"run.overwrite=true would move run.output_dir {out}, which holds the current "
            "directory: run from another directory or choose another run.output_dir"
        )
    base = aside_path(out, when)
    target, n = base, 1
    while True:
        try:
            target.mkdir()
            break
        except FileExistsError:
            n += 1
            target = base.with_name(f"{base.name}-{n}")
        except OSError as exc:
            raise RunDirError(_cannot_move(out, target, exc)) from None
    try:
        os.rename(out, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            target.rmdir()
        raise RunDirError(_cannot_move(out, target, exc)) from None
    return target


def _cannot_move(out: Path, target: Path, exc: OSError) -> str:
    return (
        f"run.overwrite=true: cannot move run.output_dir {out} aside to {target}: "
        f"{exc.strerror or exc}; move it yourself or choose another run.output_dir"
    )
