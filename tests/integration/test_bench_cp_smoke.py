"""Smoke tests of `scripts/bench_cp.py` (`bench.cp`, parts comm and balance_time, `--quick`):
real gloo launches.

comm, cp = 2 and cp = 4: on every rank and for one forward and one backward, flashcp's counters
must equal, byte for byte, what the wrapped `paddle.distributed.send/recv/all_gather` calls were
handed (the worker's `TransportTap`), with no other collective running, and be within 1 % of the
theoretical (cp - 1)/cp · 2·B·S·H_kv·D·bytes each way for the forward and twice that for the
backward. balance_time, cp = 2: every rank reports a time for every (family, layout), and the
pages are regenerated from the JSON. Byte counts and structure only, never timings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cp as bench

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_comm_quick_cp2_cp4_counters_equal_transport_and_theory(tmp_path: Path) -> None:
    argv = ["--part", "comm", "--quick", "--comm-cp", "2", "4", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "cp_comm.json").read_text())
    rows = result["rows"]
    cfg = result["config"]
    assert cfg["quick"] and cfg["cps"] == [2, 4]
    # (2 + 4) ranks x every mode x (forward, backward)
    assert len(rows) == 6 * len(cfg["modes"]) * 2
    assert {(r["cp"], r["rank"]) for r in rows} == {(2, 0), (2, 1), *((4, i) for i in range(4))}
    for row in rows:
        cp = row["cp"]
        expected = bench.theoretical_bytes(
            cp,
            seq_len=cfg["seq_len"],
            batch=cfg["batch"],
            kv_heads=cfg["kv_heads"],
            head_dim=cfg["head_dim"],
        )
        assert row["theoretical"] == expected[row["direction"]], row
        # the counters are what the transport was handed, nothing else ran
        assert (row["sent"], row["received"]) == (
            row["transport_sent"],
            row["transport_received"],
        ), row
        assert row["transport_other_calls"] == 0, row
        assert 0.99 <= row["ratio_sent"] <= 1.01, row
        assert 0.99 <= row["ratio_received"] <= 1.01, row
        ops, calls = row["per_op"], row["transport_calls"]
        if row["direction"] == "forward":
            assert set(ops) == {"all_gather"} and ops["all_gather"]["calls"] == 2, row
            assert calls == {"all_gather": 2}, row
        else:
            assert set(ops) == {"all_gather", "reduce_scatter"}, row
            assert ops["all_gather"]["calls"] == ops["reduce_scatter"]["calls"] == 2, row
            # ring reduce-scatter of dK and dV: cp - 1 send/recv pairs each
            assert calls == {"all_gather": 2, "send": 2 * (cp - 1), "recv": 2 * (cp - 1)}, row
        assert expected["backward"] == 2 * expected["forward"]
    doc = (tmp_path / "cp_bench.md").read_text()
    assert "| 4 | dualchunk_allgather | forward |" in doc and "| **no** |" not in doc
    assert "counters = bytes handed to `paddle.distributed` on 36 of 36" in doc


@pytest.mark.timeout(240)
def test_balance_time_quick_cp2(tmp_path: Path) -> None:
    argv = ["--part", "balance_time", "--quick", "--balance-cp", "2", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "cp_balance_time.json").read_text())
    cfg, rows = result["config"], result["rows"]
    assert cfg["quick"] and cfg["cps"] == [2]
    assert {(r["family"], r["mode"]) for r in rows} == {
        (f, m) for f in cfg["families"] for m in cfg["layouts"]
    }
    for row in rows:
        assert len(row["wall_median_per_rank"]) == 2 and min(row["wall_median_per_rank"]) > 0
        assert row["imbalance_wall"] >= 1.0 and row["model_imbalance"] >= 1.0
    causal = {r["mode"]: r for r in rows if r["family"] == "causal"}
    assert causal["dualchunk"]["model_imbalance"] == 1.0  # the model's exact case
    doc = (tmp_path / "cp_balance.md").read_text()
    assert "## Measured: per-rank attention wall time" in doc
    assert "| 2 | causal | dualchunk |" in doc
