"""Smoke test of `scripts/bench_loss_memory.py` (`bench.loss_memory`) at small sizes: both
variants, bounds, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import loss_memory as bench


def test_bench_loss_memory_smoke(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    argv = ["--sizes", "512x4096x32:128,300x1000x16:64", "--repeats", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rec = json.loads(out.read_text())
    assert [c["tokens"] for c in rec["cases"]] == [512, 300]
    for case in rec["cases"]:
        u, c = case["unchunked"], case["chunked"]
        assert len(u["peak_bytes_all"]) == len(c["peak_bytes_all"]) == 2
        assert u["peak_bytes"] >= case["unchunked_floor_bytes"] == case["logits_bytes"]
        assert c["peak_bytes"] <= case["chunked_bound_bytes"] < case["logits_bytes"] * 2
        assert case["peak_ratio"] == c["peak_bytes"] / u["peak_bytes"] < 0.5
        assert case["loss_rel_diff"] < 1e-6 and case["within_bounds"]
    md = out.with_suffix(".md").read_text()
    assert "| 512 | 4,096 | 32 | 128 |" in md and "within its bounds: yes" in md
    assert bench.main(["--json", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == md


def test_bench_loss_memory_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit, match="is not TxVxH:n"):
        bench.main(["--sizes", "512x4096:128"])
    with pytest.raises(SystemExit, match="every number must be >= 1"):
        bench.main(["--sizes", "512x4096x32:0"])
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        bench.main(["--repeats", "0"])
