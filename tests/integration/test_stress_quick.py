"""CI's short version of `scripts/stress_launch.py`: 3 consecutive 2/4/2-process launches.

The long run (100 launches) is recorded in `docs/reliability.md`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stress_launch as stress  # scripts/stress_launch.py (pytest's pythonpath)

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_quick_stress_every_launch_is_clean(tmp_path: Path) -> None:
    report = tmp_path / "stress.json"
    code = stress.main(["--quick", "--json", str(report), "--work-dir", str(tmp_path / "runs")])
    summary = json.loads(report.read_text())
    assert code == 0, json.dumps(summary["records"], indent=1)
    assert summary["clean"] == summary["launches"] == 3
    assert [r["nproc"] for r in summary["records"]] == [2, 4, 2]
    assert summary["by_nproc"] == {"2": "2/2", "4": "1/1"}
    assert not any((tmp_path / "runs").iterdir())  # clean runs are deleted
