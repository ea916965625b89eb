"""Pipeline schedules (`flashcp.pipeline.schedule`) on one process: pass order invariants, transfer
plans, deadlock freedom under blocking send / recv, and the forward-only plan (evaluation and DPO
reference passes)."""

from __future__ import annotations

import pytest

from flashcp.pipeline.schedule import (
    FORWARD,
    Op,
    build_plans,
    comm_plan,
    max_in_flight,
    schedule_1f1b,
    schedule_forward,
    schedule_gpipe,
    simulate_plans,
)

CASES = [(pp, m, s) for pp in (2, 3, 4) for m in range(pp, 2 * pp + 2) for s in range(pp)]


# -- pass order -------------------------------------------------------------------------------


def _check_order(order: list[Op], num_micro: int) -> None:
    fwd = [m for k, m in order if k == "F"]
    bwd = [m for k, m in order if k == "B"]
    assert fwd == list(range(num_micro))  # every micro-batch forwarded once, ascending
    assert bwd == list(range(num_micro))  # and back-propagated once, ascending
    for m in range(num_micro):
        assert order.index(Op("F", m)) < order.index(Op("B", m))


@pytest.mark.parametrize(("pp", "num_micro", "stage"), CASES)
def test_1f1b_invariants(pp: int, num_micro: int, stage: int) -> None:
    order = schedule_1f1b(pp, num_micro, stage)
    _check_order(order, num_micro)
    assert max_in_flight(order) == pp - stage  # never more than pp - stage in flight
    warmup = pp - stage - 1
    assert [k for k, _ in order[:warmup]] == ["F"] * warmup
    steady = order[warmup : warmup + 2 * (num_micro - warmup)]
    assert [k for k, _ in steady] == ["F", "B"] * (num_micro - warmup)
    assert [k for k, _ in order[len(order) - warmup :]] == ["B"] * warmup


@pytest.mark.parametrize(("pp", "num_micro", "stage"), CASES)
def test_gpipe_invariants(pp: int, num_micro: int, stage: int) -> None:
    order = schedule_gpipe(pp, num_micro, stage)
    _check_order(order, num_micro)
    assert max_in_flight(order) == num_micro  # GPipe keeps every micro-batch alive


def test_1f1b_examples() -> None:
    F, B = "F", "B"
    assert schedule_1f1b(4, 5, 0) == [
        (F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (F, 4), (B, 1), (B, 2), (B, 3), (B, 4),
    ]  # fmt: skip
    assert schedule_1f1b(4, 5, 3) == [
        (F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3), (F, 4), (B, 4),
    ]  # fmt: skip


@pytest.mark.parametrize("fn", [schedule_1f1b, schedule_gpipe])
def test_schedule_argument_errors(fn) -> None:
    with pytest.raises(ValueError, match="1 micro-batches for 2 pipeline stages: the schedule "
                       "needs at least pp = 2"):  # fmt: skip
        fn(2, 1, 0)
    with pytest.raises(ValueError, match="stage 2 is outside 0..1"):
        fn(2, 4, 2)
    with pytest.raises(ValueError, match="parallel.pp must be >= 1"):
        fn(0, 4, 0)
    with pytest.raises(ValueError, match="pipeline schedule 'zb' is unknown"):
        build_plans("zb", 2, 4)
    with pytest.raises(ValueError, match="neither 'F' nor 'B'"):
        comm_plan([Op("W", 0)], 0, 2)


# -- transfers and deadlock freedom -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "num_micro"), sorted({(pp, m) for pp, m, _ in CASES}))
def test_plans_are_deadlock_free_and_respect_dependencies(kind, pp, num_micro) -> None:
    plans = build_plans(kind, pp, num_micro)
    for s, plan in enumerate(plans):
        for k, m in plan:
            if k == "F" and s > 0:
                assert plan.index(Op("recv_act", m)) < plan.index(Op("F", m))
            if k == "send_act":
                assert plan.index(Op("F", m)) < plan.index(Op(k, m))
            if k == "B" and s < pp - 1:
                assert plan.index(Op("recv_grad", m)) < plan.index(Op("B", m))
            if k == "send_grad":
                assert plan.index(Op("B", m)) < plan.index(Op(k, m))
        assert (s == 0) == all(k != "recv_act" for k, _ in plan)
        assert (s == pp - 1) == all(k != "send_act" for k, _ in plan)
    trace = simulate_plans(plans)
    assert len(trace) == sum(len(p) for p in plans)
    when = {(s, op): i for i, (s, op) in enumerate(trace)}
    for s in range(pp - 1):
        for m in range(num_micro):  # data flow: forward down the pipe, backward up
            assert when[(s, Op("F", m))] < when[(s + 1, Op("F", m))]
            assert when[(s + 1, Op("B", m))] < when[(s, Op("B", m))]


def test_naive_transfer_order_deadlocks() -> None:
    """Without the receive-activation-before-sending-gradient fix, 1F1B deadlocks on gloo."""

    def naive(order: list[Op], stage: int, pp: int) -> list[Op]:
        """Receive right before each pass, send right after it; no reordering."""
        ops: list[Op] = []
        for k, m in order:
            if k == "F":
                ops += [Op("recv_act", m)] if stage > 0 else []
                ops += [Op("F", m)] + ([Op("send_act", m)] if stage < pp - 1 else [])
            else:
                ops += [Op("recv_grad", m)] if stage < pp - 1 else []
                ops += [Op("B", m)] + ([Op("send_grad", m)] if stage > 0 else [])
        return ops

    plans = [naive(schedule_1f1b(2, 4, s), s, 2) for s in range(2)]
    with pytest.raises(RuntimeError, match="deadlocks .* stage 0: Op\\(kind='send_act'"):
        simulate_plans(plans)


def test_comm_plan_example() -> None:
    plan = comm_plan(schedule_1f1b(2, 3, 1), 1, 2)
    assert plan == [
        ("recv_act", 0), ("F", 0), ("B", 0), ("recv_act", 1), ("send_grad", 0),
        ("F", 1), ("B", 1), ("recv_act", 2), ("send_grad", 1), ("F", 2), ("B", 2),
        ("send_grad", 2),
    ]  # fmt: skip


def test_forward_only_plan_streams_micro_batches() -> None:
    assert schedule_forward(3, 2, 1) == [("F", 0), ("F", 1)]
    plans = build_plans(FORWARD, 3, 2)
    assert plans[0] == [("F", 0), ("send_act", 0), ("F", 1), ("send_act", 1)]
    assert plans[2] == [("recv_act", 0), ("F", 0), ("recv_act", 1), ("F", 1)]
    simulate_plans(plans)  # deadlock-free
    assert build_plans(FORWARD, 2, 1)  # fewer micro-batches than stages is fine without backward
    with pytest.raises(ValueError, match=">= 1 micro-batch"):
        schedule_forward(2, 0, 0)
