"""Automatic restarts decided (`flashcp.launch.restart`): which failures are relaunched, the
backoff, the checkpoint a relaunch resumes from, the record; and the nodes of a job agreeing
through their shared run directory (`flashcp.launch.nodesync`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from flashcp import rundir
from flashcp.checkpoint import format as ck
from flashcp.config import load_config
from flashcp.config.overrides import parse_override
from flashcp.launch import outcome, restart
from flashcp.launch.nodesync import NodeSync
from flashcp.launch.restart import Decision, Report
from helpers.checkpoints import save_checkpoint
from helpers.paths import CONFIGS

KIND = {"killed": "killed", "hang": "timeout", "peer lost": "peer", "error": "error"}


def _report(node: int = 0, code: int = 247, cause: str = "killed", at: float = 1.0,
            kind: str | None = None) -> Report:  # fmt: skip
    return Report(node, code, cause, 1, "died", at, kind or KIND[cause])


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [restart.backoff_s(10, n) for n in (1, 2, 3)] == [10, 20, 40]
    assert restart.backoff_s(10, 9) == restart.BACKOFF_MAX_S
    assert restart.backoff_s(0, 4) == 0


def test_a_failure_a_relaunch_can_fix_restarts_until_the_budget_is_used() -> None:
    got = restart.decide({0: _report()}, restarts=0, max_restarts=2)
    assert got.restart and (got.cause, got.rank, got.node, got.why) == ("killed", 1, 0, "")
    used = restart.decide({0: _report()}, restarts=2, max_restarts=2)
    assert not used.restart and used.code == 247 and "all 2 restarts" in used.why
    off = restart.decide({0: _report()}, restarts=0, max_restarts=0)
    assert not off.restart and off.why == "run.max_restarts is 0"


@pytest.mark.parametrize("code", sorted(outcome.FINAL_CODES))
def test_what_a_relaunch_cannot_fix_never_restarts(code: int) -> None:
    """A refused config, a non-finite loss, a broken checkpoint, bad data, a pre-emption: on
    any node, whatever the other nodes saw."""
    reports = {0: _report(0, 1, "peer lost"), 1: _report(1, code, "error", at=2.0)}
    got = restart.decide(reports, restarts=0, max_restarts=5, nodes=2)
    assert not got.restart and got.code == code and got.node == 1
    assert f"(exit {code}) is not fixed by a relaunch" in got.why


def test_the_node_that_saw_the_cause_is_blamed_and_a_silent_node_is_lost() -> None:
    reports = {0: _report(0, 1, "peer lost", at=1.0), 1: _report(1, 124, "hang", at=5.0)}
    got = restart.decide(reports, restarts=0, max_restarts=1, nodes=2)
    assert got.restart and (got.node, got.cause, got.code) == (1, "hang", 124)
    # both nodes saw the hang: the one whose rank never reached the collective is blamed, not
    # the one whose ranks timed out waiting for it first
    waited = {0: _report(0, 124, "hang", at=1.0), 1: _report(1, 247, "hang", 5.0, "hung")}
    assert restart.decide(waited, restarts=0, max_restarts=1, nodes=2).node == 1
    lost = restart.decide({0: _report(0, 1, "peer lost"), 1: None}, restarts=0,
                          max_restarts=3, nodes=2)  # fmt: skip
    assert not lost.restart and (lost.cause, lost.node) == ("node lost", 1)
    assert Decision.from_json(json.loads(json.dumps(got.to_json()))) == got


def _save(root: Path, step: int) -> None:
    arrays = {"w": np.full(3, step, np.float32)}
    save_checkpoint(root, step, model=arrays, optimizer=arrays, state={})


def test_a_relaunch_resumes_from_the_latest_complete_checkpoint_by_name(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "gpt" / "tiny_cp2.yaml",
                      [f"run.output_dir={tmp_path}", "checkpoint.resume=never"])  # fmt: skip
    assert restart.relaunch_overrides(cfg) == (["run.overwrite=false"], None)
    root = tmp_path / ck.CHECKPOINT_DIR
    _save(root, 2)
    _save(root, 4)
    (root / "step_6.tmp").mkdir()  # a save that did not finish: never resumed from
    overrides, step = restart.relaunch_overrides(cfg)
    assert step == 4
    assert [parse_override(o).value for o in overrides] == [False, str(root / "step_4")]
    relaunched = load_config(CONFIGS / "gpt" / "tiny_cp2.yaml",
                             [f"run.output_dir={tmp_path}", "run.overwrite=true", *overrides])
    assert relaunched.checkpoint.resume == str(root / "step_4") and not relaunched.run.overwrite


def test_records_append_to_the_runs_restarts_file(tmp_path: Path) -> None:
    assert rundir.restart_records(tmp_path) == []
    d = restart.decide({0: _report()}, restarts=0, max_restarts=1)
    for n in (1, 2):
        restart.append_record(tmp_path, restart.RestartRecord.of(d, n, 2 * n, 0.5 * n))
    got = rundir.restart_records(tmp_path)
    assert [(r["restart"], r["resume_step"], r["backoff_s"]) for r in got] == [(1, 2, 0.5),
                                                                                (2, 4, 1.0)]
    assert got[0]["cause"] == "killed" and got[0]["rank"] == 1 and got[0]["exit_code"] == 247


# -- the nodes' rendezvous --------------------------------------------------------------------


def test_nodes_agree_through_the_run_directory(tmp_path: Path) -> None:
    zero, one = NodeSync(tmp_path, 0, 2), NodeSync(tmp_path, 1, 2)
    assert zero.failed_elsewhere(0) is None and one.failed_elsewhere(0) is None
    one.report(0, _report(1, 247, "killed"))
    assert zero.failed_elsewhere(0) == _report(1, 247, "killed")  # node 0 stops its ranks
    assert one.failed_elsewhere(0) is None  # its own report does not count
    decided: list[object] = []
    follower = threading.Thread(target=lambda: decided.append(one.decision(0, timeout=10)))
    follower.start()
    zero.report(0, _report(0, 1, "peer lost"))
    reports = zero.reports(0, timeout=10)
    decision = restart.decide(reports, restarts=0, max_restarts=1, nodes=2)
    zero.publish(0, decision, ["checkpoint.resume=\"/x\""], 4)
    follower.join(10)
    assert decided == [(decision, ["checkpoint.resume=\"/x\""], 4)]
    assert decision.restart and decision.node == 1


def test_a_node_that_never_reports_is_lost_and_node_0_clears_old_files(tmp_path: Path) -> None:
    zero, one = NodeSync(tmp_path, 0, 2), NodeSync(tmp_path, 1, 2)
    zero.report(3, _report(0, 1, "peer lost"))
    assert zero.reports(3, timeout=0.2) == {0: _report(0, 1, "peer lost"), 1: None}
    assert one.decision(3, timeout=0.2) is None  # node 0 lost, from node 1's side
    assert one.decision(3, timeout=10, stop=lambda: True) is None  # a signal ends the wait
    one.reset()  # only node 0 clears
    assert any(zero.dir.iterdir())
    zero.reset()
    assert list(zero.dir.iterdir()) == []
