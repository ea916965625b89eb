"""`flashcp.preemption`: whether a pre-emption (up to two steps and a whole save) fits
`run.preempt_grace_s` — by the plan's checkpoint bytes at start, by the first committed save's
time — and the line rank 0 says when one is asked for."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from flashcp.checkpoint.format import MODEL_FILE, OPTIMIZER_FILE
from flashcp.checkpoint.saving import SAVED, STALL, SaveReport
from flashcp.config import load_config
from flashcp.plan import plan
from flashcp.preemption import (
    GraceCheck,
    grace_warning,
    planned_grace_warning,
    preempt_seconds,
    stop_message,
)
from flashcp.rundir import CHECKPOINT_DIR
from helpers.configs import TinyCfg
from helpers.paths import CONFIGS
from helpers.trainruns import Fit

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


def _report(stall: float, committed: int | None = None) -> SaveReport:
    metrics = {STALL: stall}
    if committed is not None:
        metrics[SAVED] = float(committed)
    return SaveReport(metrics=metrics)


def test_the_first_commit_is_judged_once_by_the_save_that_made_it() -> None:
    """An asynchronous save stalls little at its own step and commits at a later one: the
    judgement takes the committed step's save (its stall, plus the background write), the
    committing step's time, and happens once."""
    cfg = load_config(CP2, ["run.preempt_grace_s=10", "checkpoint.async=true"])
    grace = GraceCheck(cfg, write_s=lambda: 5.0)
    assert grace.observe(2, 1.0, _report(3.0), due=True) is None  # saving, not yet committed
    text = grace.observe(3, 2.0, _report(0.25, committed=2), due=False)
    # 2 × 2 s + (3 s stall at step 2 + 5 s write) = 12 s > 10 s
    assert text is not None and "about 12 s (up to two steps of 2 s and a save of 8 s, as " \
        "the one of step 2 took)" in text  # fmt: skip
    assert grace.observe(4, 9.0, _report(0.25, committed=2), due=False) is None  # judged once
    sync = load_config(CP2, ["run.preempt_grace_s=10"])
    fits = GraceCheck(sync, write_s=lambda: 5.0)  # no background write counted
    assert fits.observe(1, 2.0, _report(3.0, committed=1), due=True) is None  # 7 s fits


def test_the_stop_line_names_each_rank_and_its_signal() -> None:
    line = stop_message(7, {3: int(signal.SIGUSR1), 1: int(signal.SIGTERM), 2: 200})
    assert line == (
        "pre-emption requested on rank(s) 1 (SIGTERM), 2 (signal 200), 3 (SIGUSR1): saving "
        "step 7 and stopping (run the same command again to resume)"
    )
