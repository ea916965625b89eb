"""Smoke test of `scripts/bench_checkpoint_stall.py` (`bench.checkpoint_stall`) on a tiny model:
both modes through the real trainer, per-round ratios, the page and its verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import checkpoint_stall as bench


def test_bench_checkpoint_stall_smoke(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["--hidden", "32", "--layers", "1", "--rounds", "2", "--dir", str(tmp_path),
            "--min-write-s", "1000", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 1  # a tiny model writes in far less than 1000 s: refused
    rec = json.loads(out.read_text())
    saves = rec["saves"]
    assert [s["side"] for s in saves] == ["async", "sync", "sync", "async"]  # rotated rounds
    assert all(s["stall_s"] > 0 and s["write_s"] > 0 and s["wait_s"] == 0 for s in saves)
    assert all(s["overlapping_steps_s"] == [] for s in saves if s["side"] == "sync")
    steps = [s["step"] for s in saves]
    assert steps == sorted(steps) and len(set(steps)) == 4  # one save per step, in order
    per_round = [a["stall_s"] / s["stall_s"] for a, s in ((saves[0], saves[1]),
                                                           (saves[3], saves[2]))]  # fmt: skip
    assert rec["ratio_all"] == pytest.approx(per_round)
    assert rec["ratio"]["median"] == pytest.approx(sum(per_round) / 2)
    assert rec["model"]["checkpoint_bytes"] > 3 * 4 * rec["model"]["parameters"] - 1
    md = out.with_suffix(".md").read_text()
    assert "took at least 1000.0 s as asked: NO" in md
    assert bench.main(["--json", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == md
    assert list(tmp_path.glob("flashcp-stall-*")) == []  # the checkpoints are removed


def test_bench_checkpoint_stall_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit, match="multiple of 16"):
        bench.main(["--hidden", "40"])
