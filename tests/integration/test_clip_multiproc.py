"""THE global gradient norm under expert parallelism, directly, on 2 gloo processes.

The gap mutation testing found (issue 19): ignoring the expert-parallel sum of squares in the
clip passed the EP parity test, because the logged norm came from another code path; only a
bitwise-resume test caught it. Now one norm is logged and clips (`flashcp.optim.clip`), and this
test checks it directly (`workers/clip_worker.py`): at ep = 2 (× cp = 2), with `ParamOptimizer`
and with the ZeRO-1 `MasterOptimizer`, the norm and the parameters after a clipped and an
unclipped step equal one process's — Paddle's AdamW with Paddle's own clip on the whole model —
under the float32 rule of `bench.numerics`; the same optimizers with the ep sum left out of
their norm (the mutant) must FAIL both comparisons by far.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "clip_worker.py"
FAST_FAIL = {"FLASHCP_COLLECTIVE_TIMEOUT": "60", "FLASHCP_INIT_TIMEOUT": "60"}
MARGIN = 10.0
"""A negative control must miss the allowance by at least this factor."""
pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


@pytest.mark.timeout(180)
def test_the_norm_under_ep_equals_one_process(tmp_path: Path) -> None:
    result = run_launch(WORKER, 2, ["--out", str(tmp_path)], timeout=150, env=FAST_FAIL)
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["rank"] == rank
        assert report["want_norms"][0] > 1.0 > report["want_norms"][1]  # clipped, then not
        for run in ("param", "zero"):
            ok = report[run]
            for cmp in [*ok["norm_cmp"], ok["params_cmp"]]:
                assert cmp["ok"], (rank, cmp["describe"])
            mutant = report[f"{run}_control"]
            for cmp in [*mutant["norm_cmp"], mutant["params_cmp"]]:
                assert cmp["error"] > MARGIN * cmp["allowed"], (rank, cmp["describe"])
