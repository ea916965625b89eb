"""Smoke test of `scripts/bench_offload_memory.py` (`bench.offload_memory`): with offload the
allocator holds, between forward and backward, exactly the layer inputs less (layers × tokens ×
hidden × the residual dtype's bytes), which is what the host holds at its peak; the per-token
slopes say the same."""

from __future__ import annotations

import json

import pytest

from bench import offload_memory
from flashcp.models import preset


def test_offload_rows_and_slopes(capsys: pytest.CaptureFixture[str]) -> None:
    lengths = [64, 128]
    argv = ["--preset", "tiny_glm", "--layers", "3", "--lengths", *map(str, lengths)]
    assert offload_memory.main([*argv, "--modes", "frozen", "--chunk", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    hidden = preset("tiny_glm").hidden_size
    rows = result["rows"]
    assert len(rows) == 2 * 2 * len(lengths)  # dtypes × lengths × offload off / on
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        for seq in lengths:
            plain, moved = (
                next(r for r in rows if (r["residual_dtype"], r["seq"], r["offload"]) == key)
                for key in ((dtype, seq, False), (dtype, seq, True))
            )
            kept = 3 * seq * hidden * width
            assert plain["held_after_forward"] - moved["held_after_forward"] == kept
            assert moved["host_peak"] == moved["offloaded"] == kept
            assert plain["host_peak"] == 0
    slopes = {(s["residual_dtype"], s["offload"]): s for s in result["slopes"]}
    assert slopes[("float32", True)]["host_peak_per_token"] == 3 * hidden * 4
    assert slopes[("bfloat16", True)]["host_peak_per_token"] == 3 * hidden * 2
