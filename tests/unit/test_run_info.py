"""`flashcp.run_info`: a run's provenance (versions, git commit, command line, times) and how
it ended, in `run_info.json`, and its last line; each checked against its own source (the
installed packages, `git` itself, the metrics the run wrote). (Whether a pre-emption fits
`run.preempt_grace_s`: tests/unit/test_preemption.py.)"""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import paddle
import pytest

from flashcp.config import build_config
from flashcp.metrics.writer import read_metrics
from flashcp.run_info import (
    COMMAND_ENV,
    RunEnd,
    command_line,
    duration,
    finish_run,
    source_revision,
)
from flashcp.rundir import CHECKPOINT_DIR, RUN_INFO_FILE
from flashcp.trainer import NonFiniteError
from helpers.configs import TinyCfg
from helpers.paths import ROOT
from helpers.trainruns import Fit, nan_model


def _info(run: str | Path) -> dict:
    return json.loads((Path(run) / RUN_INFO_FILE).read_text())


def _git(*args: str) -> str | None:
    """git's answer about this checkout (None: not a checkout, or no git)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT / "src" / "flashcp"), *args],
                              capture_output=True, text=True, check=False)  # fmt: skip
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def test_a_run_records_what_made_it_and_how_it_ended(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COMMAND_ENV, "flashcp train my.yaml train.steps=3")
    cfg = tiny_cfg(tmp_path, train={"steps": 3}, checkpoint={"every": 3})
    _, result, out = fit(cfg)
    info = _info(cfg.run.output_dir)
    made = info["provenance"]
    assert made["flashcp"] == version("flashcp") and made["paddle"] == paddle.__version__
    assert made["command"] == "flashcp train my.yaml train.steps=3"
    commit = _git("rev-parse", "HEAD")
    if commit is None:  # an unpacked source tree: no commit is claimed
        assert made["git"] is None
    else:
        assert made["git"]["commit"] == commit
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        assert made["git"]["dirty"] == bool(dirty)
    end = info["end"]
    rows = read_metrics(cfg.run.output_dir)
    assert end["status"] == "completed" and (end["first_step"], end["final_step"]) == (1, 3)
    assert end["final_loss"] == rows[-1]["loss"]
    assert end["wall_time_s"] > 0 and made["started"] <= end["ended"]
    assert end["checkpoint"] == str(Path(cfg.run.output_dir) / "checkpoints" / "step_3")
    last = out.strip().splitlines()[-1]
    assert last.startswith("flashcp pretrain: completed at step 3 of 3 in ")
    assert f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}" in last
    assert f"run {cfg.run.output_dir}" in last


def test_a_stopped_or_failed_run_says_so(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    cfg = tiny_cfg(tmp_path / "stop", train={"steps": 4}, run={"stop_after_steps": 2})
    out = fit(cfg).out
    assert _info(cfg.run.output_dir)["end"]["status"] == "stopped"
    assert "flashcp pretrain: stopped at step 2 of 4" in out.strip().splitlines()[-1]
    bad = tiny_cfg(tmp_path / "nan", train={"steps": 4})
    with pytest.raises(NonFiniteError):
        fit(bad, model_factory=lambda c, s: nan_model(c, at=2))
    end = _info(bad.run.output_dir)["end"]
    assert end["status"] == "failed: NonFiniteError" and end["final_step"] == 1


def test_command_line_and_source_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(COMMAND_ENV, raising=False)
    assert command_line(["/x/src/flashcp/train.py", "--config", "a b.yaml"]) == \
        "train.py --config 'a b.yaml'"  # fmt: skip
    assert source_revision(tmp_path) is None  # not a checkout: no commit claimed
    assert [duration(s) for s in (4.25, 245, 7380)] == ["4.2 s", "4m 05s", "2h 03m"]


def _end(cfg, **given: object) -> RunEnd:  # type: ignore[no-untyped-def]
    """`RunEnd.of` with the arguments of a completed three-step run, some of them `given`."""
    args: dict = dict(started=100.0, first_step=1, final_step=3, losses=[2.5, 2.0, 1.5],
                      evaluated={}, failure=None, preempted=False)  # fmt: skip
    return RunEnd.of(cfg, **{**args, **given})


def test_the_end_record_status_losses_and_newest_checkpoint(tmp_path: Path) -> None:
    """`RunEnd.of` (what the trainer fills at the end of `fit`): a failure wins over a
    pre-emption, a pre-emption over the step count; the first and last losses of the steps
    run; the newest checkpoint in the run directory by step, not by name."""
    cfg = build_config({"model": {"preset": "tiny"}, "train": {"steps": 3},
                        "run": {"output_dir": str(tmp_path)}})  # fmt: skip
    done = _end(cfg)
    assert (done.status, done.first_loss, done.final_loss) == ("completed", 2.5, 1.5)
    assert done.checkpoint is None and done.total_steps == 3 and done.ended >= done.started
    assert _end(cfg, final_step=2).status == "stopped"
    assert _end(cfg, preempted=True).status == "pre-empted"
    failed = _end(cfg, preempted=True, failure=KeyboardInterrupt())
    assert failed.status == "failed: KeyboardInterrupt"
    assert _end(cfg, losses=[]).final_loss is None
    for step in (2, 10):
        (tmp_path / CHECKPOINT_DIR / f"step_{step}").mkdir(parents=True)
    assert _end(cfg).checkpoint == str(tmp_path / CHECKPOINT_DIR / "step_10")
    # finish_run: the end into run_info.json; the last line unless the run failed
    (tmp_path / RUN_INFO_FILE).write_text(json.dumps({"world": 1}))
    line = finish_run(cfg, _end(cfg, evaluated={"eval/loss": 1.25}))
    assert line is not None and line.startswith("flashcp pretrain: completed at step 3 of 3")
    assert "loss 2.5000 -> 1.5000 | eval/loss 1.2500 | checkpoint " in line
    assert _info(tmp_path)["end"]["eval"] == {"eval/loss": 1.25}
    assert finish_run(cfg, failed) is None
    assert _info(tmp_path)["end"]["status"] == "failed: KeyboardInterrupt"
