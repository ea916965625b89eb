"""Smoke test of `scripts/bench_dpo.py` (`bench.dpo`) at tiny size: both layouts train on the
same answers, passes interleaved, and the page is generated from the JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench import dpo as bench

TINY = ["--preset", "tiny_glm", "--seq-len", "256", "--repeat", "1"]


def test_bench_dpo_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench.main([*TINY, "--epochs", "2", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    packed, unpacked = rec["layouts"]["packed"], rec["layouts"]["unpacked"]
    assert rec["examples"] == 52 and rec["speedup"]["median"] > 0
    # the same answers: every pair's two answers, identical label tokens, in both layouts
    cov = rec["coverage"]
    assert cov["pairs"] == 52 and cov["answers"] == 104 and cov["identical_in_both_layouts"]
    assert rec["max_initial_ref_logp_diff"] < 1e-3
    # interleaved: one pass of each per round, the order reversed every round
    assert [r["order"] for r in rec["rounds"]] == [["packed", "unpacked"], ["unpacked", "packed"]]
    assert len(packed["pass_seconds"]) == len(unpacked["pass_seconds"]) == 2
    assert packed["positions_per_pass"] < unpacked["positions_per_pass"]  # prompts once, less pad
    md = out.with_suffix(".md").read_text()
    assert "Speed-up of packing" in md and "| packed |" in md and "Same answers" in md
    # the page is a function of the JSON alone
    assert bench.main(["--json", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == md


def test_check_same_answers_refuses_layouts_that_differ() -> None:
    args = bench.parse_args(TINY)
    batches = bench.layouts(args, bench.build_examples(args))
    cov = bench.check_same_answers(batches)
    assert cov["answers"] == 2 * cov["pairs"] and cov["answer_tokens"] > cov["answers"]
    # negative controls: an answer missing from one layout, or trained on other tokens
    with pytest.raises(RuntimeError, match="cover different answers"):
        bench.check_same_answers({"packed": batches["packed"][1:], "unpacked": batches["unpacked"]})
    first = batches["unpacked"][0]
    labels = first.labels.copy()
    row, start, _ = (int(x) for x in first.spans[0, 0])
    labels[row, start] += 1
    changed = [dataclasses.replace(first, labels=labels), *batches["unpacked"][1:]]
    with pytest.raises(RuntimeError, match="train different tokens"):
        bench.check_same_answers({"packed": batches["packed"], "unpacked": changed})
