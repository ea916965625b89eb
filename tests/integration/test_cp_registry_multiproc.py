"""A CP mode registered by a worker alone (layout + implementation, nothing in src/ edited)
runs the model at CP = 2 and equals CP = 1; see `workers/cp_registry_worker.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "cp_registry_worker.py"
pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


@pytest.mark.timeout(200)
def test_registered_mode_at_cp2_equals_single_process(tmp_path: Path) -> None:
    result = run_launch(WORKER, 2, ["--out", str(tmp_path)], timeout=180)
    assert result.ok, result.summary()
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [c["recompute"] for c in report["cases"]] == ["none", "refined"]
        for case in report["cases"]:
            assert case["chunks"] == [1 - rank]  # rank r holds chunk cp-1-r
            assert case["ok"], case
