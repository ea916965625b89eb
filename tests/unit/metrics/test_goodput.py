"""The goodput ledger (`flashcp.metrics.goodput`): productive step time over wall time, and
where the rest went — start-up, checkpoint stalls, restarts (steps redone included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp import attempt, rundir
from flashcp.metrics.goodput import KEEP_SAVES, Goodput, Totals, read_goodput


def _ledger(tmp: Path, index: int = 0, started: float = 100.0, launched: float = 100.0) -> Goodput:
    return Goodput(tmp, attempt=attempt.Attempt(index, started, launched), enabled=True)


def test_a_run_from_its_launch_to_its_end(tmp_path: Path) -> None:
    g = _ledger(tmp_path)
    g.start(None, now=110.0)  # 10 s from the launch to the first step
    g.step(1, 2.0, now=112.5)  # 0.5 s of the 2.5 outside the step: other
    g.checkpoint(1, 1.0, now=113.5)
    g.step(2, 2.0, now=115.5)
    t = g.totals
    assert (t.wall_s, t.productive_s, t.startup_s, t.checkpoint_s) == (15.5, 4.0, 10.0, 1.0)
    assert t.other_s == pytest.approx(0.5) and t.goodput == pytest.approx(4.0 / 15.5)
    assert t.saves == {"1": 2.0}
    assert g.finish(complete=True) == tmp_path / rundir.GOODPUT_FILE
    on_disk = json.loads((tmp_path / rundir.GOODPUT_FILE).read_text())
    assert on_disk["complete"] and on_disk["goodput"] == pytest.approx(4.0 / 15.5)
    assert g.metrics()["goodput/ratio"] == pytest.approx(4.0 / 15.5)
    assert g.metrics()["restarts"] == 0.0


def test_a_restart_charges_the_downtime_and_the_steps_redone(tmp_path: Path) -> None:
    """Attempt 0 saved step 2 and did step 3, then died; the relaunch resumes from step 2: step
    3's time and everything from the last update to the relaunched first step are restart."""
    g = _ledger(tmp_path)
    g.start(None, now=100.0)
    for step, now in ((1, 101.0), (2, 102.0)):
        g.step(step, 1.0, now=now)
    g.checkpoint(2, 0.0, now=102.0)
    g.step(3, 1.0, now=103.0)  # lost with the failure
    (tmp_path / rundir.RESTARTS_FILE).write_text('{"restart": 1}\n')
    again = _ledger(tmp_path, index=1, started=100.0, launched=110.0)
    again.start(2, now=120.0)
    t = again.totals
    assert t.productive_s == 2.0 and t.restart_s == 1.0 + 17.0 and t.wall_s == 20.0
    assert t.step == 2 and t.restarts == 1 and again.metrics()["restarts"] == 1.0


def test_a_later_command_resumes_the_ledger_without_the_time_between(tmp_path: Path) -> None:
    """A pre-empted run started again by hand: its start-up counts, the hours it waited for
    the scheduler do not."""
    g = _ledger(tmp_path)
    g.start(None, now=100.0)
    g.step(1, 1.0, now=101.0)
    g.checkpoint(1, 0.5, now=101.5)
    g.finish(complete=False)
    later = _ledger(tmp_path, started=5000.0, launched=5000.0)
    later.start(1, now=5004.0)
    t = later.totals
    assert (t.wall_s, t.startup_s, t.restart_s, t.productive_s) == (5.5, 4.0, 0.0, 1.0)
    assert not t.complete


def test_a_fresh_start_ignores_an_old_ledger_and_estimates_missing_saves(tmp_path: Path) -> None:
    old = Totals(wall_s=50, productive_s=40, step=4, saves={})
    (tmp_path / rundir.GOODPUT_FILE).write_text(json.dumps(old.to_json()))
    fresh = _ledger(tmp_path)
    fresh.start(None, now=101.0)
    assert fresh.totals.wall_s == 1.0 and fresh.totals.productive_s == 0.0
    assert old.productive_at(2) == 20.0  # no record of step 2's save: the mean step's share
    assert Totals().productive_at(3) == 0.0
    (tmp_path / rundir.GOODPUT_FILE).write_text("{not json")
    assert read_goodput(tmp_path) is None


def test_only_rank_0_keeps_a_ledger(tmp_path: Path) -> None:
    off = Goodput(tmp_path, attempt=attempt.Attempt(), enabled=False)
    off.start(None)
    off.step(1, 1.0)
    off.checkpoint(1, 1.0)
    assert off.finish(True) is None and off.metrics() == {}
    assert not (tmp_path / rundir.GOODPUT_FILE).exists()


def test_the_ledger_remembers_the_newest_saves(tmp_path: Path) -> None:
    g = _ledger(tmp_path)
    g.start(None, now=100.0)
    for step in range(1, KEEP_SAVES + 3):
        g.step(step, 1.0, now=100.0 + step)
        g.checkpoint(step, 0.0, now=100.0 + step)
    g.checkpoint(None, 0.5, now=200.0)  # an asynchronous save's commit: no new checkpoint
    assert sorted(map(int, g.totals.saves)) == list(range(3, KEEP_SAVES + 3))
    assert g.totals.checkpoint_s == 0.5
