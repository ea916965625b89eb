"""The LR schedule's fit to the run (`flashcp.optim.lr`): a default warmup never outlasts a
short run, so every run decays to `train.min_lr` on its last step; a warmup the config sets is
kept as set (the golden jobs' schedules), and the start line says when it leaves no decay."""

from __future__ import annotations

import pytest

from flashcp.config import TrainConfig
from flashcp.optim.lr import (
    DEFAULT_WARMUP,
    build_scheduler,
    describe,
    lr_at,
    schedule_note,
    warmup_steps,
)


@pytest.mark.parametrize("steps", [1, 2, 5, 9, 20, 60])
def test_a_short_run_decays_to_min_lr(steps: int) -> None:
    """Default warmup: a tenth of the run (at most 10 steps); the run still reaches min_lr
    on its last step and never rises after the warmup."""
    t = TrainConfig(steps=steps, lr=1.0, min_lr=0.1)
    w = warmup_steps(t)
    assert w == min(DEFAULT_WARMUP, steps // 10)
    got = [lr_at(i, t) for i in range(steps)]
    if steps > 1:
        assert got[-1] == pytest.approx(0.1)  # decayed fully on the last step
    assert max(got) == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(got[w:], got[w + 1 :], strict=False))
    sched = build_scheduler(t)  # Paddle's scheduler follows the same factors
    for i in range(steps):
        assert sched.get_lr() == pytest.approx(got[i])
        sched.step()


def test_the_old_fixed_warmup_never_decayed_a_short_run() -> None:
    """Control: the previous default (10 steps of warmup) on a 5-step run only warms up; set
    explicitly it is kept as set, and the start line's note says so."""
    t = TrainConfig(steps=5, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [lr_at(i, t) for i in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert "leaves no decay in 5 steps" in (schedule_note(t) or "")


def test_long_runs_keep_the_ten_step_warmup() -> None:
    t = TrainConfig(steps=100)
    assert warmup_steps(t) == 10 and schedule_note(t) is None
    assert describe(t) == "lr 0.0003, warmup 10, cosine to 3e-05 over 90 steps"
    short = describe(TrainConfig(steps=30))
    assert short.startswith("lr 0.0003, warmup 3, cosine to 3e-05 over 27 steps (warmup a ")
