"""Smoke test of `scripts/bench_tiling_memory.py` (`bench.tiling_memory`) at small sizes: the
tiled slope is below the untiled one, the page renders from the record alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tiling_memory as bench


def test_bench_tiling_memory_smoke(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["--lengths", "256,512", "--tiles", "0,32", "--layers", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rec = json.loads(out.read_text())
    plain, tiled = rec["cases"]
    assert (plain["tile"], tiled["tile"]) == (0, 32)
    assert tiled["peak_slope"] < 0.7 * plain["peak_slope"]
    assert tiled["kept_bytes"] == plain["kept_bytes"]  # the forward keeps the same tensors
    for a, b in zip(plain["losses"], tiled["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    md = out.with_suffix(".md").read_text()
    assert "| 0 (off) |" in md and "| 32 |" in md
    assert bench.main(["--json", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == md


def test_bench_tiling_memory_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="at least two lengths"):
        bench.main(["--lengths", "512"])
    with pytest.raises(SystemExit, match="integers >= 0"):
        bench.main(["--tiles", "-1"])
