"""The forward-only pipeline plan (evaluation and DPO reference passes)."""

from __future__ import annotations

import pytest

from flashcp.pipeline.schedule import FORWARD, build_plans, schedule_forward, simulate_plans


def test_forward_only_plan_streams_micro_batches() -> None:
    assert schedule_forward(3, 2, 1) == [("F", 0), ("F", 1)]
    plans = build_plans(FORWARD, 3, 2)
    assert plans[0] == [("F", 0), ("send_act", 0), ("F", 1), ("send_act", 1)]
    assert plans[2] == [("recv_act", 0), ("F", 0), ("recv_act", 1), ("F", 1)]
    simulate_plans(plans)  # deadlock-free
    assert build_plans(FORWARD, 2, 1)  # fewer micro-batches than stages is fine without backward
    with pytest.raises(ValueError, match=">= 1 micro-batch"):
        schedule_forward(2, 0, 0)
