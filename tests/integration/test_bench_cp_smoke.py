"""Smoke test of `scripts/bench_cp.py --part comm --quick`: real 2-process gloo launch.

Checks byte counts, not timings: flashcp's counters must report, per rank, exactly the
theoretical (cp - 1)/cp · 2·B·S·H_kv·D·bytes each way for one forward and twice that for one
backward (within [0.99, 1.01]), and the generated JSON and markdown must be written.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_cp.py"
pytestmark = pytest.mark.integration


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_cp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cp"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(180)
def test_comm_quick_cp2_bytes_match_theory(tmp_path: Path) -> None:
    bench = _load_bench()
    code = bench.main(["--part", "comm", "--quick", "--comm-cp", "2", "--out-dir", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "cp_comm.json").read_text())
    rows = result["rows"]
    cfg = result["config"]
    assert cfg["quick"] and cfg["cps"] == [2]
    # 2 ranks x every mode x (forward, backward)
    assert len(rows) == 2 * len(cfg["modes"]) * 2
    assert {r["rank"] for r in rows} == {0, 1}
    assert {r["direction"] for r in rows} == {"forward", "backward"}
    expected = bench.theoretical_bytes(
        2,
        seq_len=cfg["seq_len"],
        batch=cfg["batch"],
        kv_heads=cfg["kv_heads"],
        head_dim=cfg["head_dim"],
    )
    for row in rows:
        assert row["theoretical"] == expected[row["direction"]], row
        assert 0.99 <= row["ratio_sent"] <= 1.01, row
        assert 0.99 <= row["ratio_received"] <= 1.01, row
        ops = row["per_op"]
        if row["direction"] == "forward":
            assert set(ops) == {"all_gather"} and ops["all_gather"]["calls"] == 2, row
        else:
            assert set(ops) == {"all_gather", "reduce_scatter"}, row
            assert ops["all_gather"]["calls"] == ops["reduce_scatter"]["calls"] == 2, row
    assert expected["backward"] == 2 * expected["forward"]
    begin, end = bench.markers("comm")
    doc = (tmp_path / "cp_bench.md").read_text()
    assert begin in doc and end in doc and "| 2 | dualchunk_allgather | forward |" in doc
