"""CP attention on 2 and 4 gloo processes vs the single-process dense reference, per rank.

The worker (`workers/cp_parity_worker.py`) compares every rank's output, LSE, dq, dk and dv for
every mask family (and per-head masks) under every CP mode with the float32 rule of
`bench.numerics`, checks that a wrong shard fails the comparison by a wide margin, and that
two runs of the same case are bitwise identical (same layout and order: bitwise by
construction).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.numerics import FACTOR
from flashcp import mask_families
from flashcp.attention.registry import MODES
from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "cp_parity_worker.py"
pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


def _expected_cases() -> int:
    per_head = {"sliding_window_per_head": 2, "random_eviction": 2}
    return sum(1 + per_head.get(f, 0) for f in mask_families.FAMILIES) * len(MODES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [2, 4])
def test_cp_parity_every_family_every_mode(nproc: int, tmp_path: Path) -> None:
    result = run_launch(WORKER, nproc, ["--out", str(tmp_path)], timeout=270)
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    for rank in range(nproc):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world"] == nproc
        cases = report["cases"]
        assert len(cases) == _expected_cases()
        assert {c["family"] for c in cases} == set(mask_families.FAMILIES)
        assert {c["mode"] for c in cases} == set(MODES)
        for case in cases:
            assert case["ok"] and max(case["units"].values()) <= FACTOR, case
            assert case["wrong_shard_rejected"] and case["wrong_units"] > 10 * FACTOR, case
        assert report["bitwise"], f"rank {rank}: two identical runs differ"
        assert report["frozen_k"], f"rank {rank}: a frozen k changed the other gradients"
