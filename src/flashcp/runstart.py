"""May a run start in its run directory, and moving an earlier run aside (`run.overwrite`).

What a run writes to `run.output_dir` is named in `flashcp.rundir`. A fresh run (`checkpoint.resume:
never`) in a directory that already holds checkpoints would mix two runs, so it is refused, with the
three ways out (`start_problems`): continue the run (`checkpoint.resume=auto`), start over in the
same place (`run.overwrite=true`), or write elsewhere (another `run.output_dir`). A run that would
start from step 0 (no checkpoint to continue from, whatever `checkpoint.resume` says) over the
`metrics.jsonl` of an earlier run would truncate it, so it is refused too (`metrics_problems`), with
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
find there is their own run's. Each check reports `list[Problem]` (`flashcp.problems`) keyed
`run.output_dir`; `check_start` and `move_aside` raise them
as one `RunDirError`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from flashcp.attempt import current as current_attempt
from flashcp.checkpoint.format import list_checkpoints
from flashcp.problems import Problem, ProblemsError
from flashcp.rundir import ASIDE, CHECKPOINT_DIR, LOCK_FILE, LOG_DIR, METRICS_FILE

OUTPUT_DIR = "run.output_dir"


class RunDirError(ProblemsError, RuntimeError):
    """The run cannot start in `run.output_dir` (or it cannot be moved aside): its problems,
    one line each, every one naming the ways out. (A `RuntimeError` too, as it was.)"""

    def render(self) -> str:
        return "\n".join(str(p) for p in self.problems)


def earlier_run(output_dir: str | Path) -> list[str]:
    """Names of what an earlier run left in `output_dir` (all entries but `logs/` and the
    lock), sorted."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name not in (LOG_DIR, LOCK_FILE))


def checkpoint_problems(output_dir: str | Path, resume: str) -> list[Problem]:
    """The refusal of a fresh run (`resume` never) over checkpoints; empty when there is none."""
    if resume != "never":
        return []
    found = list_checkpoints(Path(output_dir) / CHECKPOINT_DIR)
    if not found:
        return []
    return [Problem(
        OUTPUT_DIR,
        f"{output_dir} already holds checkpoints ({found[-1][1].name}) and checkpoint.resume "
        "is never",
        other="set checkpoint.resume=auto to continue that run, run.overwrite=true to move it "
        "aside and start over, or choose another run.output_dir",
    )]  # fmt: skip


def metrics_problems(output_dir: str | Path, resume: str) -> list[Problem]:
    """The refusal of a run that would start from step 0 over an earlier run's metrics.

    Empty when `resume` names a checkpoint, when there is a checkpoint to continue from (resume
    `auto`; `never` over checkpoints is `checkpoint_problems`), or when `metrics.jsonl` is
    missing or empty.
    """
    out = Path(output_dir)
    if resume not in ("never", "auto") or list_checkpoints(out / CHECKPOINT_DIR):
        return []
    metrics = out / METRICS_FILE
    try:
        records = sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        return []
    if not records:
        return []
    return [Problem(
        OUTPUT_DIR,
        f"{output_dir} holds {METRICS_FILE} of an earlier run ({records} step record(s)) and no "
        "checkpoint to continue from, so this run would start from step 0 and overwrite it",
        other="set run.overwrite=true to move the earlier run aside and start over, or choose "
        "another run.output_dir",
    )]  # fmt: skip


def fresh_start_problems(output_dir: str | Path, resume: str) -> list[Problem]:
    """`checkpoint_problems`, else `metrics_problems`: why a run may not write here."""
    return checkpoint_problems(output_dir, resume) or metrics_problems(output_dir, resume)


def holds_cwd(output_dir: str | Path) -> bool:
    """Whether the current directory is `output_dir` or inside it (it cannot be moved away)."""
    out = Path(output_dir).resolve()
    cwd = Path.cwd().resolve()
    return cwd == out or out in cwd.parents


def start_problems(output_dir: str | Path, resume: str, overwrite: bool) -> list[Problem]:
    """Why a rank cannot start in `output_dir` (empty: it can). Ranks never move a run aside."""
    if overwrite:
        found = earlier_run(output_dir)
        if not found:
            return []
        return [Problem(
            OUTPUT_DIR,
            f"{output_dir} holds an earlier run ({', '.join(found)}) and run.overwrite is true",
            other="`flashcp train` moves it aside before launching, the ranks of a job started "
            "by paddle.distributed.launch do not: run `flashcp train CONFIG run.overwrite=true`, "
            f"or move {output_dir} away yourself",
        )]  # fmt: skip
    return fresh_start_problems(output_dir, resume)


def check_start(output_dir: str | Path, resume: str, overwrite: bool) -> None:
    """Raise `RunDirError` when a run cannot start in `output_dir` (`start_problems`); never
    in a relaunch of the same run (`flashcp.attempt`)."""
    if current_attempt().relaunch:
        return
    if problems := start_problems(output_dir, resume, overwrite):
        raise RunDirError(problems)


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
        raise RunDirError([Problem(
            OUTPUT_DIR, f"{out} holds the current directory, so run.overwrite=true cannot move it",
            other="run from another directory or choose another run.output_dir",
        )])  # fmt: skip
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


def _cannot_move(out: Path, target: Path, exc: OSError) -> list[Problem]:
    return [Problem(
        OUTPUT_DIR,
        f"run.overwrite=true cannot move {out} aside to {target}: {exc.strerror or exc}",
        other="move it yourself or choose another run.output_dir",
    )]  # fmt: skip
