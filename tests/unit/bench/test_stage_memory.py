"""Smoke test of `scripts/bench_stage_memory.py` (`bench.stage_memory`): every build runs in its
own process through the entry script, a stage holds its share of the whole model's parameters,
and the storage dtype sets the bytes per parameter."""

from __future__ import annotations

import json

import pytest

from bench import stage_memory


def test_stage_builds_hold_their_share(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "tiny_glm", "--pp", "2", "--dtypes", "float32", "bfloat16"]
    assert stage_memory.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    builds = [(1, 0), (2, 0), (2, 1)]  # the whole model, then each of the two stages
    assert [(r["dtype"], r["pp"], r["stage"]) for r in rows] == [
        (dtype, pp, stage) for dtype in ("float32", "bfloat16") for pp, stage in builds
    ]
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        whole, *stages = [r for r in rows if r["dtype"] == dtype]
        assert sum(r["params"] for r in stages) == whole["params"] > 0
        for r in (whole, *stages):
            assert r["held"] == width * r["params"] and r["peak"] >= r["held"]
    page = stage_memory.table("tiny_glm", 0, 1.0, rows)
    assert page.startswith("tiny_glm layers=preset (1 s)\n") and "| stage 1/2 | bfloat16 |" in page
