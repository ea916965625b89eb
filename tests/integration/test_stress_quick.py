"""CI's short version of `scripts/stress_launch.py`: 3 consecutive 2/4/2-process launches.

The long run (100 launches) is recorded in `docs/reliability.md`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stress_launch.py"


def _load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("stress_launch", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_quick_stress_every_launch_is_clean(tmp_path: Path) -> None:
    stress = _load_script()
    report = tmp_path / "stress.json"
    code = stress.main(["--quick", "--json", str(report), "--work-dir", str(tmp_path / "runs")])
    summary = json.loads(report.read_text())
    assert code == 0, json.dumps(summary["records"], indent=1)
    assert summary["clean"] == summary["launches"] == 3
    assert [r["nproc"] for r in summary["records"]] == [2, 4, 2]
    assert summary["by_nproc"] == {"2": "2/2", "4": "1/1"}
    assert not any((tmp_path / "runs").iterdir())  # clean runs are deleted
