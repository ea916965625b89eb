"""Chunked all-gather-KV attention on 2 and 4 gloo processes vs the unchunked implementation.

The worker (`workers/chunked_attention_worker.py`) compares every rank's output, LSE, dq, dk
and dv for causal, document, share-question, sliding-window and per-head masks under every CP
mode and four chunk shapes with the unchunked all-gather-KV implementation and the dense
oracle (the float32 rule of `bench.numerics`), checks that a merge without the LSE rescale
fails by a wide margin and that a repeated case is bitwise identical, and measures the
allocator peak of one attention forward + backward chunked and unchunked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.numerics import FACTOR
from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "chunked_attention_worker.py"
pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nproc", [2, 4])
def test_chunked_attention_matches_unchunked_per_rank(nproc: int, tmp_path: Path) -> None:
    result = run_launch(WORKER, nproc, ["--out", str(tmp_path)], timeout=400)
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    for rank in range(nproc):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world"] == nproc
        cases = report["cases"]
        assert len(cases) == 5 * 3 * 4  # families × modes × chunk shapes
        for case in cases:
            assert case["ok"], case
            assert max(*case["units"].values(), *case["dense_units"].values()) <= FACTOR
        assert report["naive_merge_rejected"] and report["wrong_units"] > 10 * FACTOR
        assert report["bitwise"], f"rank {rank}: two identical runs differ"
        # per global token, the unchunked peak grows with the gathered K/V and the float32
        # dK/dV partial sums of all S keys; the chunked one only with the local rows
        small, large = report["memory"]
        tokens = large["seq"] - small["seq"]
        plain = (large["unchunked"] - small["unchunked"]) / tokens
        chunked = (large["chunked"] - small["chunked"]) / tokens
        assert chunked < 0.8 * plain, report["memory"]
        assert large["chunked"] < large["unchunked"], report["memory"]
