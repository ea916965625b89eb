"""Smoke test of `scripts/bench_moe.py` (`bench.moe`) at a small size: every variant agrees
with the loop, the report is written and re-rendered from the JSON, the balance comparison
runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import moe as bench


def test_bench_moe_smoke(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    argv = ["--cases", "64x16x8", "--repeats", "2", "--skew", "--balance-steps", "2",
            "--ep-cases", "", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rec = json.loads(out.read_text())
    assert [c["case"] for c in rec["cases"]] == ["64x16x8", "64x16x8 skewed"]
    for case in rec["cases"]:
        assert set(case["variants"]) == set(bench.VARIANTS)
        for v in case["variants"].values():
            assert len(v["cpu_s"]) == len(v["wall_s"]) == 2 and v["speedup"] > 0
        assert max(case["max_rel_diff"].values()) < 1e-6  # same outputs and gradients
    skewed = rec["cases"][1]
    assert skewed["load_max_over_mean"] > 2 * rec["cases"][0]["load_max_over_mean"]
    assert len(rec["balance"]["on"]) == len(rec["balance"]["off"]) == 2
    md = out.with_suffix(".md").read_text()
    assert "| 64x16x8 skewed |" in md and "## Router load balancing" in md
    assert bench.main(["--json", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == md


def test_bench_moe_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="is not TxHxI"):
        bench.main(["--cases", "64x16"])
    with pytest.raises(SystemExit, match="an even hidden size"):
        bench.main(["--cases", "64x15x8"])
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        bench.main(["--repeats", "0"])
    with pytest.raises(SystemExit, match="--rate > 0"):
        bench.main(["--rate", "0"])
    with pytest.raises(SystemExit, match="--ep must be >= 2 and divide 128"):
        bench.main(["--ep", "3"])
