"""`flashmask_attention_cp(q, k, v, mask)` without `group` on 2 and 4 gloo processes.

`group=None` means the world group, as in `paddle.distributed`, after plain
`paddle.distributed.init_parallel_env()` (upstream style) and after flashcp's own
`init_distributed()` + `build_groups` (with 4 ranks, dp=2 x cp=2 sub-groups exist too). The
worker (`workers/cp_default_group_worker.py`) compares every rank's output, LSE, dq, dk and dv
with the dense float64 reference under the float32 rule of `bench.numerics`; negative
controls: another rank's rows fail it by a wide margin, and the old one-rank reading of `None`
refuses the call.
The same masks in upstream's "values >= S" form give bitwise-identical results (same process
and layout, so bitwise by construction), and the byte counters and watchdog message name the
world group.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "cp_default_group_worker.py"
FAST_FAIL = {"FLASHCP_COLLECTIVE_TIMEOUT": "60", "FLASHCP_INIT_TIMEOUT": "60"}
pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("init", ["paddle", "flashcp"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_group_none_is_the_world_group(nproc: int, init: str, tmp_path: Path) -> None:
    result = run_launch(
        WORKER, nproc, ["--out", str(tmp_path), "--init", init], timeout=120, env=FAST_FAIL
    )
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    label = f"world[{','.join(map(str, range(nproc)))}]"
    for rank in range(nproc):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (report["rank"], report["world"], report["init"]) == (rank, nproc, init)
        assert report["label"] == label
        assert [c["family"] for c in report["cases"]] == ["causal_document", "document"]
        for case in report["cases"]:
            assert case["ok"], case
            assert case["wrong_shard_rejected"], case
            assert case["overshoot_values"] > 0, case
            assert case["overshoot_bitwise"], case
        for op, want in report["expected_stats"].items():
            got = report["stats"][op]
            assert got["calls"] == want["calls"], (op, got, want)
            assert got["sent"] == got["received"] == want["sent"], (op, got, want)
        assert f"on group {label} timed out" in report["timeout_message"]
        seq, local = report["seq"], report["seq"] // nproc
        assert (
            f"covers {seq} keys but the global sequence is {local}" in (report["single_rank_error"])
        )
        assert f"group=None means the world group ({nproc} ranks" in report["implicit_error"]
