"""`scripts/bench_kernel.py` (`bench.kernel`): the per-document baseline's document detection
(against the dense oracle, with negative controls) and a `--quick` run: implementations
interleaved per round, ≥ 3 rounds, ratios and the active-tile bound reported, the page
generated from the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench import kernel as bench
from flashcp import masks


def test_document_segments() -> None:
    causal = bench.document_segments(masks.causal_document_mask([3, 5, 8]))
    assert causal == {"lengths": [3, 5, 8], "causal": True}
    assert bench.document_segments(masks.document_mask([4, 12])) == {
        "lengths": [4, 12],
        "causal": False,
    }
    assert bench.document_segments(masks.causal_mask(1, 16)) == {"lengths": [16], "causal": True}
    # not block-diagonal documents: no per-document equivalent
    assert bench.document_segments(masks.share_question_mask([[4, 3, 3]], seq_len=16)) is None
    assert bench.document_segments(masks.sliding_window_mask(1, 16, 4)) is None
    per_head = masks.Mask(np.repeat(masks.causal_mask(1, 16).indices, 2, axis=1), causal=True)
    assert bench.document_segments(per_head) is None


def test_quick_run_interleaves_and_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["workload"]["rounds"] >= 3
    points = {(r["family"], r["seq_len"]): r for r in rep["results"]}
    head = points[("causal_document_8docs", 1024)]
    assert set(head["impls"]) == {"flashcp", "sdpa", "varlen"} and head["documents"] == 8
    # every round ran every implementation, the order rotated from round to round
    assert len(head["orders"]) == 3 and len({tuple(o) for o in head["orders"]}) == 3
    for rec in head["impls"].values():
        assert len(rec["total_s"]) == 3 and min(rec["total_s"]) > 0
    assert head["active_tile_heads"] == 8 * (head["tiles"]["partial"] + head["tiles"]["full"])
    row = rep["summary"]["families"]["causal_document_8docs"]["1024"]
    assert row["speedup"] > 0 and row["varlen_ratio"] > 0 and row["pct_of_bound"]["median"] > 0
    assert max(row["checksum_rel_diff"].values()) < 1e-6  # the baselines compute the same thing
    page = out.with_suffix(".md").read_text()
    assert page == bench.PAGE.render(rep) and "% of bound" in page
