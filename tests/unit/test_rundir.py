"""The run directory's names (`flashcp.rundir`): a tiny run writes only entries rundir names,
and the one reader of `restarts.jsonl`."""

from __future__ import annotations

from pathlib import Path

from flashcp import rundir
from helpers.configs import TinyCfg
from helpers.trainruns import Fit


def test_a_run_writes_only_what_rundir_names(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 2}, checkpoint={"every": 1, "keep_last": 1},
                   debug={"dump_grads": True})  # fmt: skip
    fit(cfg)
    written = {p.name for p in Path(cfg.run.output_dir).iterdir()}
    assert written <= set(rundir.ENTRIES), sorted(written - set(rundir.ENTRIES))
    assert written >= {rundir.CONFIG_FILE, rundir.METRICS_FILE, rundir.RUN_INFO_FILE,
                       rundir.GOODPUT_FILE, rundir.CHECKPOINT_DIR, rundir.GRADS_DIR}


def test_restart_records_read_every_record_and_skip_a_torn_line(tmp_path: Path) -> None:
    assert rundir.restart_records(tmp_path) == []
    (tmp_path / rundir.RESTARTS_FILE).write_text('{"restart": 1}\n\n{"restart": 2}\n{"rest')
    assert rundir.restart_records(tmp_path) == [{"restart": 1}, {"restart": 2}]
