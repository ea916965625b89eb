"""`flashcp.run_info`: a run's provenance (versions, git commit, command line, times) and how
it ended, in `run_info.json`, and its last line; each checked against its own source (the
installed packages, `git` itself, the metrics the run wrote). And whether a pre-emption fits
`run.preempt_grace_s`: by the plan's checkpoint bytes at start, by the first save's time."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import paddle
import pytest

from flashcp.checkpoint.format import MODEL_FILE, OPTIMIZER_FILE
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.plan import plan
from flashcp.run_info import (
    COMMAND_ENV,
    command_line,
    duration,
    grace_warning,
    planned_grace_warning,
    preempt_seconds,
    source_revision,
)
from flashcp.rundir import CHECKPOINT_DIR, RUN_INFO_FILE
from flashcp.trainer import NonFiniteError
from helpers.configs import TinyCfg
from helpers.paths import CONFIGS, ROOT
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


# -- pre-emption grace -----------------------------------------------------------------------

CP2 = CONFIGS / "gpt" / "tiny_cp2.yaml"


def test_a_preemption_takes_up_to_two_steps_and_a_save() -> None:
    assert preempt_seconds(3.0, 4.0) == 10.0 and preempt_seconds(None, 4.0) == 4.0
    cfg = load_config(CP2, ["run.preempt_grace_s=9"])
    text = grace_warning(cfg, step_s=3.0, save_s=4.0, basis="4 s, measured")
    assert text is not None and text.startswith("warning: run.preempt_grace_s is 9 s")
    assert "about 10 s (up to two steps of 3 s and a save of 4 s, measured)" in text
    assert grace_warning(cfg, step_s=2.0, save_s=4.0, basis="x") is None  # 8 s fits


def test_the_plan_says_at_start_when_the_grace_cannot_fit_the_save() -> None:
    """The most bytes a rank writes per checkpoint (the stage writer's model and optimizer
    state: 1.5 MB for the tiny GPT) at `hardware.checkpoint_write_gb_per_s`."""
    slow = ["hardware.checkpoint_write_gb_per_s=0.0001", "run.preempt_grace_s=5"]
    text = planned_grace_warning(load_config(CP2, slow))
    assert text is not None and "a save of 0.00139 GiB per writer at 0.0001 GB/s" in text
    assert "about 15 s" in text  # 1,496,064 B at 10^5 B/s; no peak_tflops: no step estimate
    assert planned_grace_warning(load_config(CP2, [*slow, "run.preempt_grace_s=20"])) is None
    assert planned_grace_warning(load_config(CP2)) is None  # no bandwidth: judged later


@pytest.mark.usefixtures("isolated_environ")
def test_the_planned_checkpoint_bytes_are_what_a_save_writes(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 1}, checkpoint={"every": 1})
    planned = [r.checkpoint_bytes for r in plan(cfg).host.ranks]
    _, _, out = fit(cfg)
    step = Path(cfg.run.output_dir) / CHECKPOINT_DIR / "step_1"
    written = sum((step / name).stat().st_size for name in (MODEL_FILE, OPTIMIZER_FILE))
    assert len(planned) == 1 and planned[0] == pytest.approx(written, rel=0.02)
    # the first save is judged against the grace period: 120 s fits a tiny save
    assert "preempt_grace_s" not in out
    tight = tiny_cfg(tmp_path / "tight", train={"steps": 1}, checkpoint={"every": 1},
                     run={"preempt_grace_s": 1e-6})  # fmt: skip
    assert "warning: run.preempt_grace_s is 1e-06 s but a pre-emption here needs" in fit(tight).out
    planned = tiny_cfg(tmp_path / "planned", train={"steps": 1}, run={"preempt_grace_s": 1e-6},
                       hardware={"checkpoint_write_gb_per_s": 1.0})  # fmt: skip
    assert "per writer at 1 GB/s, by the plan" in fit(planned).out  # said at start
