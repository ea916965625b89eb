"""May a run start in its directory (`flashcp.runstart`): which starts are refused, and
`run.overwrite` moving an earlier run aside (renamed whole, never copied or deleted) — through
`flashcp train`'s `run_job` too, with the job replaced by a process that exits 0."""

from __future__ import annotations

import errno
import io
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from flashcp import attempt, runstart
from flashcp.config import load_config
from flashcp.launch import job, preflight
from flashcp.problems import Problem
from flashcp.rundir import CHECKPOINT_DIR
from helpers.paths import CONFIGS

STAMP = 1_700_000_000.0  # a fixed local time for aside names


def _earlier_run(out: Path, steps: tuple[int, ...] = (2, 4)) -> dict[str, bytes]:
    """A directory shaped like a finished run; returns every file's bytes by relative path."""
    for step in steps:
        d = out / CHECKPOINT_DIR / f"step_{step}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(os.urandom(64))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    (out / "logs").mkdir()
    (out / "logs" / "workerlog.0").write_text("step 1/4 | loss 5.5\n")
    return _files(out)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_earlier_run_ignores_logs_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert runstart.earlier_run(out) == []  # missing
    (out / "logs").mkdir(parents=True)
    assert runstart.earlier_run(out) == []  # what the launcher writes before the ranks start
    (out / "metrics.jsonl").write_text("")
    assert runstart.earlier_run(out) == ["metrics.jsonl"]
    assert runstart.earlier_run(out / "metrics.jsonl") == []  # a file is not a run directory


def test_fresh_run_over_checkpoints_is_refused_with_three_ways_out(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _earlier_run(out)
    problems = runstart.checkpoint_problems(out, "never")
    line = str(problems[0])
    assert [p.key for p in problems] == ["run.output_dir"]
    assert line == (
        f"run.output_dir: {out} already holds checkpoints (step_4) and checkpoint.resume is "
        "never: set checkpoint.resume=auto to continue that run, run.overwrite=true to move it "
        "aside and start over, or choose another run.output_dir"
    )
    assert "\n" not in line
    assert runstart.checkpoint_problems(out, "auto") == []
    assert runstart.checkpoint_problems(tmp_path / "empty", "never") == []
    assert runstart.start_problems(out, "never", False) == problems
    with pytest.raises(runstart.RunDirError) as err:
        runstart.check_start(out, "never", False)
    assert str(err.value) == line
    runstart.check_start(out, "auto", False)  # continuing is fine


def test_a_relaunch_continues_its_own_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks relaunched by an automatic restart (`FLASHCP_ATTEMPT` > 0) find their own run's
    metrics there, with no checkpoint yet when it failed before the first save: not refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    monkeypatch.delenv(attempt.ENV_ATTEMPT, raising=False)
    with pytest.raises(runstart.RunDirError, match="holds metrics.jsonl of an earlier run"):
        runstart.check_start(out, "auto", False)
    monkeypatch.setenv(attempt.ENV_ATTEMPT, "1")
    runstart.check_start(out, "auto", False)


def test_ranks_never_move_an_earlier_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    runstart.check_start(out, "never", True)  # only logs: what `flashcp train` left after moving
    before = _earlier_run(tmp_path / "old")
    with pytest.raises(runstart.RunDirError, match=r"run\.output_dir: "
                       r".*old holds an earlier run \(checkpoints, metrics\.jsonl\) and "
                       r"run\.overwrite is true: "
                       r"`flashcp train` moves it aside before launching.*run `flashcp train "
                       r"CONFIG run\.overwrite=true`, or move .*old away yourself"):  # fmt: skip
        runstart.check_start(tmp_path / "old", "auto", True)
    assert _files(tmp_path / "old") == before


def test_move_aside_renames_whole_and_never_collides(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert runstart.move_aside(out, STAMP) is None  # nothing there
    out.mkdir()
    assert runstart.move_aside(out, STAMP) is None  # empty: nothing to keep
    first = _earlier_run(out)
    moved = runstart.move_aside(out, STAMP)
    assert moved == runstart.aside_path(out, STAMP)
    assert re.fullmatch(r"run\.old-\d{8}-\d{6}", moved.name), moved.name  # YYYYmmdd-HHMMSS
    assert not out.exists() and _files(moved) == first
    second = _earlier_run(out, steps=(6,))
    again = runstart.move_aside(out, STAMP)  # same second: the next free name
    assert again == moved.with_name(moved.name + "-2")
    assert _files(again) == second and _files(moved) == first


def test_move_aside_refuses_to_move_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    before = _earlier_run(out)
    monkeypatch.chdir(out / "logs")
    assert runstart.holds_cwd(out) and runstart.holds_cwd(".")
    assert not runstart.holds_cwd(tmp_path / "x")
    for target in (out, Path("..")):
        with pytest.raises(runstart.RunDirError, match="holds the current directory, so") as info:
            runstart.move_aside(target)
        assert str(info.value) == (
            f"run.output_dir: {target} holds the current directory, so run.overwrite=true cannot "
            "move it: run from another directory or choose another run.output_dir"
        )
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_move_aside_failure_leaves_everything_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    before = _earlier_run(out)

    def cross_device(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src))

    monkeypatch.setattr(runstart.os, "rename", cross_device)
    moved = r"run\.output_dir: run\.overwrite=true cannot move .*run aside"
    moved += r" to .*run\.old-\d{8}-\d{6}: "
    with pytest.raises(runstart.RunDirError, match=moved + "Invalid cross-device link: move it"):
        runstart.move_aside(out)
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_move_aside_cannot_reserve_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    before = _earlier_run(out)

    def no_space(self: Path, *a: Any, **k: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "mkdir", no_space)
    with pytest.raises(runstart.RunDirError, match="No space left on device: move it yourself"):
        runstart.move_aside(out)
    monkeypatch.undo()
    assert _files(out) == before


def _quiet_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_job` launches `python -c pass` (exit 0) instead of the training job."""
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: [sys.executable, "-c", "pass"])
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)
    monkeypatch.delenv("FLAGS_flash_attn_version", raising=False)


CONFIG = CONFIGS / "gpt" / "tiny_cp2.yaml"


def _run_job(out: Path | str, *overrides: str, printed: io.StringIO | None = None) -> int:
    """`flashcp train CONFIG OVERRIDES run.output_dir=OUT`'s launch, from its loaded config."""
    args = [*overrides, f"run.output_dir={out}"]
    return job.run_job(load_config(CONFIG, args), CONFIG, args, out=printed or io.StringIO())


def test_run_job_moves_the_earlier_run_aside_before_launching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _quiet_job(monkeypatch)
    out = tmp_path / "run"
    before = _earlier_run(out)
    printed = io.StringIO()
    code = _run_job(out, "checkpoint.resume=never", "run.overwrite=true", printed=printed)
    assert code == 0, capsys.readouterr().err
    (moved,) = tmp_path.glob("run.old-*")
    assert _files(moved) == before  # every file, byte for byte
    assert printed.getvalue().splitlines()[0] == (
        f"flashcp: run.overwrite: moved the earlier run in {out} to {moved}"
    )
    assert sorted(p.name for p in out.iterdir()) == ["logs"]  # a fresh directory was launched into
    assert runstart.earlier_run(out) == []


def test_run_job_refuses_fresh_run_over_checkpoints_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _quiet_job(monkeypatch)
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "run"
    before = _earlier_run(out)
    code = _run_job(out, "checkpoint.resume=never")
    err = capsys.readouterr().err
    assert code == preflight.EXIT_PREFLIGHT
    assert err == f"flashcp: cannot launch: {runstart.checkpoint_problems(out, 'never')[0]}\n"
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_run_job_overwrite_refuses_to_move_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _quiet_job(monkeypatch)
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "run"
    before = _earlier_run(out)
    monkeypatch.chdir(out)
    code = _run_job(".", "run.overwrite=true")
    assert code == preflight.EXIT_PREFLIGHT
    assert "holds the current directory, so run.overwrite=true cannot" in capsys.readouterr().err
    assert _files(out) == before


def test_run_from_step_0_over_earlier_metrics_is_refused(tmp_path: Path) -> None:
    """No checkpoint to continue from (every=0 runs) but metrics.jsonl has records: starting
    again would truncate them, under `auto` as under `never`; `overwrite` is the way out."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.1}\n')
    want = (
        f"run.output_dir: {out} holds metrics.jsonl of an earlier run (2 step record(s)) and no "
        "checkpoint to continue from, so this run would start from step 0 and overwrite it: "
        "set run.overwrite=true to move the earlier run aside and start over, or choose "
        "another run.output_dir"
    )
    for resume in ("never", "auto"):
        assert [str(p) for p in runstart.metrics_problems(out, resume)] == [want]
        assert [str(p) for p in runstart.start_problems(out, resume, False)] == [want]
        with pytest.raises(runstart.RunDirError, match="would start from step 0"):
            runstart.check_start(out, resume, False)
    assert runstart.metrics_problems(out, str(out / "checkpoints" / "step_2")) == []
    assert runstart.start_problems(out, "auto", True) != []  # ranks never move a run
    (out / "metrics.jsonl").write_text("\n")  # an empty file holds no run
    assert runstart.metrics_problems(out, "never") == []
    assert runstart.metrics_problems(tmp_path / "missing", "auto") == []


def test_resume_auto_over_checkpoints_and_metrics_continues(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _earlier_run(out)
    assert runstart.metrics_problems(out, "auto") == []  # the checkpoint continues the run
    assert runstart.fresh_start_problems(out, "auto") == []
    assert runstart.fresh_start_problems(out, "never") == runstart.checkpoint_problems(out, "never")


def test_run_job_refuses_run_over_earlier_metrics_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _quiet_job(monkeypatch)
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    before = _files(out)
    code = _run_job(out, "checkpoint.resume=auto")
    assert code == preflight.EXIT_PREFLIGHT
    err = capsys.readouterr().err
    assert err == f"flashcp: cannot launch: {runstart.metrics_problems(out, 'auto')[0]}\n"
    assert _files(out) == before


def test_several_run_directory_problems_print_one_line_each() -> None:
    """`RunDirError` prints its problems one per line, with no heading (the caller's line
    says what could not start)."""
    a = Problem("run.output_dir", "first", other="way one")
    b = Problem("run.output_dir", "second")
    want = "run.output_dir: first: way one\nrun.output_dir: second"
    assert str(runstart.RunDirError([a, b])) == want
