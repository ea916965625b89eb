"""Pipeline schedules on one process: pass order invariants, transfer plans, deadlock
freedom under blocking send / recv, and the runner run stage by stage in one process.

The last part replaces the transport with an in-process mailbox and interleaves the stages'
steps in the order `simulate_plans` derives, so PP = 2 / 3 execution is checked against the
sequential model (bitwise) without launching processes; `tests/integration` does the real one.
The loss is the LM recipe's own (`flashcp.recipes.lm.LMRecipe.loss`), normalised by the step's
target count as the trainer does (`flashcp.recipes.base.normalised`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.config import IGNORE_INDEX, build_config
from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups, comm_stats
from flashcp.distributed.p2p import (
    PipelineLinks,
    pipeline_links,
    recv_tensor,
    send_tensor,
    swap_tensor,
)
from flashcp.models import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    HeadInput,
    build_model,
    preset,
)
from flashcp.pipeline import runner as pipeline_mod
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.pipeline.schedule import (
    Op,
    build_plans,
    comm_plan,
    max_in_flight,
    schedule_1f1b,
    schedule_gpipe,
    simulate_plans,
)
from flashcp.pipeline.stage import build_stage
from flashcp.recipes.base import normalised
from flashcp.recipes.lm import LMRecipe

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


# -- p2p argument checks (no peer needed) -----------------------------------------------------


def test_p2p_argument_errors() -> None:
    solo = NamedGroup("pp", 0, -1, [0], pg=None)
    x = paddle.ones([2])
    with pytest.raises(ValueError, match="peer rank 3 is not in group pp\\[0\\]"):
        send_tensor(x, 3, solo)
    with pytest.raises(ValueError, match="cannot exchange a tensor with itself"):
        recv_tensor([2], "float32", 0, solo)
    with pytest.raises(TypeError, match="needs an explicit group"):
        swap_tensor(x, 1, None, send_first=True)  # type: ignore[arg-type]
    outsider = NamedGroup("pp", -1, 5, [2, 3], pg=None)
    with pytest.raises(ValueError, match="rank 0 is not a member of group pp\\[2,3\\]"):
        send_tensor(x, 2, outsider)


def _fake_groups(pp: int, stage: int) -> ParallelGroups:
    ranks = list(range(pp))
    group = NamedGroup("pp", stage, 77, ranks, pg=None)  # backend "none": used as is
    solo = NamedGroup("cp", 0, -1, [stage], pg=None)
    dims = ParallelDims(dp=1, pp=pp, cp=1, world_size=pp)
    return ParallelGroups(dims, stage, group, solo, group, solo, "none")


def test_pipeline_links_without_gloo_use_the_pp_group() -> None:
    g = _fake_groups(3, 1)
    links = pipeline_links(g)
    assert links.prev is g.pp and links.next is g.pp and links.ends is None
    first = _fake_groups(3, 0)
    tied = pipeline_links(first, tied=True)
    assert tied.prev is None and tied.next is first.pp and tied.ends is first.pp
    assert pipeline_links(_fake_groups(1, 0)) == PipelineLinks(None, None, None)


# -- the runner, stage by stage in one process ------------------------------------------------


def _micro_batches(num_micro: int, seq: int = 32) -> tuple[list[MicroBatch], Any]:
    """Micro-batches and the LM recipe's loss of the step: summed cross-entropy / its count."""
    rng = np.random.default_rng(11)
    raw = []
    for _ in range(num_micro):
        ids = rng.integers(0, 260, (2, seq))
        labels = np.roll(ids, -1, axis=1)
        lens = [[12, seq - 12], [5, 11, seq - 16]]
        for b, doc in enumerate(lens):
            labels[b, np.cumsum(doc) - 1] = IGNORE_INDEX
        ctx = AttentionContext(mask=masks.causal_document_mask(lens).indices, causal=True)
        pos = np.broadcast_to(np.arange(seq), (2, seq)).copy()
        raw.append((ids, pos, labels, ctx))
    count = int(sum((labels != IGNORE_INDEX).sum() for _, _, labels, _ in raw))
    out = []
    for ids, pos, labels, ctx in raw:
        lab = paddle.to_tensor(labels)
        out.append(MicroBatch(paddle.to_tensor(ids), paddle.to_tensor(pos), lab, ctx))
    train = {"loss_chunk_tokens": DEFAULT_LOSS_CHUNK_TOKENS}
    cfg = build_config({"model": {"preset": "tiny"}, "train": train})
    return out, normalised(LMRecipe(cfg, None).loss, float(count))  # type: ignore[arg-type]


def _build(name: str, overrides: dict):
    return build_model(preset(name, **overrides), seed=0)


def _stage(name: str, overrides: dict, s: int, pp: int):
    """Stage `s` of `pp` built alone (same seed: the one-process model's weights)."""
    return build_stage(preset(name, **overrides), s, pp, seed=0)


def _grads(layer) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy() for n, p in layer.named_parameters() if p.grad is not None}


def _reference(model, mbs: list[MicroBatch], loss_fn: Any) -> list[float]:
    """One process by hand: forward, the micro-batch's loss, backward, one after the other."""
    losses = []
    for mb in mbs:
        loss, _ = loss_fn(HeadInput(model(mb.input_ids, mb.positions, mb.attn), model), mb)
        loss.backward()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize(
    ("name", "overrides", "pp", "num_micro", "kind"),
    [
        ("tiny", {}, 2, 3, "1f1b"),
        ("tiny_glm", {"num_layers": 3}, 3, 4, "1f1b"),
        ("tiny_glm", {"num_layers": 4, "recompute": "refined"}, 3, 3, "gpipe"),
    ],
)
def test_interleaved_stages_equal_sequential_bitwise(
    monkeypatch: pytest.MonkeyPatch, name, overrides, pp, num_micro, kind
) -> None:
    mbs, loss_fn = _micro_batches(num_micro)
    ref = _build(name, overrides)
    ref_losses = _reference(ref, mbs, loss_fn)
    want = _grads(ref)

    mailbox: dict[tuple[int, int], list[paddle.Tensor]] = {}
    me = {"stage": 0}

    def fake_send(x, dst, group, *, timeout=None):
        mailbox.setdefault((me["stage"], dst), []).append(x.detach().clone())

    def fake_recv(shape, dtype, src, group, *, timeout=None):
        x = mailbox[(src, me["stage"])].pop(0)
        assert list(x.shape) == list(shape) and x.dtype == dtype
        return x

    monkeypatch.setattr(pipeline_mod, "send_tensor", fake_send)
    monkeypatch.setattr(pipeline_mod, "recv_tensor", fake_recv)
    stages = [_stage(name, overrides, s, pp) for s in range(pp)]
    runners = [PipelineRunner(st, _fake_groups(pp, s), kind=kind) for s, st in enumerate(stages)]
    states = [runner.start(mbs, loss_fn) for runner in runners]
    peak = [0] * pp
    for s, op in simulate_plans(build_plans(kind, pp, num_micro)):
        me["stage"] = s
        runners[s].step(states[s], op)
        peak[s] = max(peak[s], len(states[s].outputs))
    results = [runner.finish(st) for runner, st in zip(runners, states, strict=True)]
    assert not any(mailbox.values())
    if kind == "1f1b":
        assert peak == [pp - s for s in range(pp)]  # activations held: pp - stage
    else:
        assert peak == [num_micro] * pp
    assert results[-1][0] == ref_losses
    assert all(r == ([], None) for r in results[:-1])  # the losses live on the last stage
    got = {}
    for st in stages:
        got.update(_grads(st))
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


@pytest.mark.parametrize("with_groups", [True, False], ids=["groups", "no_groups"])
def test_single_stage_step_equals_model_bitwise(with_groups: bool) -> None:
    """pp = 1 is the same runner with one stage: one process's loop, bitwise, nothing sent."""
    mbs, loss_fn = _micro_batches(2)
    ref = _build("tiny_glm", {})
    ref_losses = _reference(ref, mbs, loss_fn)
    stage = _stage("tiny_glm", {}, 0, 1)
    runner = PipelineRunner(stage, _fake_groups(1, 0) if with_groups else None)
    before = comm_stats("send").sent
    losses, _ = runner.train(mbs, loss_fn)
    assert comm_stats("send").sent == before  # pp = 1: nothing travels
    assert losses == ref_losses
    got, want = _grads(stage), _grads(ref)
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_single_stage_runs_micro_batches_one_after_the_other(kind: str) -> None:
    """One stage: forward, loss, backward per micro-batch whatever the schedule (one in flight,
    as the memory planner counts at pp = 1)."""
    runner = PipelineRunner(_stage("tiny", {}, 0, 1), kind=kind)
    assert runner.plan(3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_forward_only_equals_model_without_gradients() -> None:
    """One stage: `out_fn` on each micro-batch's hidden states, in order, no gradients; no
    micro-batches is no pass (a dp rank without rows in a short last eval batch)."""
    mbs, _ = _micro_batches(2)
    stage = _stage("tiny_glm", {}, 0, 1)
    runner = PipelineRunner(stage)
    got = runner.forward_only(mbs, lambda out, mb: out.logits().numpy())
    with paddle.no_grad():
        want = [stage.logits(stage(mb.input_ids, mb.positions, mb.attn)).numpy() for mb in mbs]
    assert got is not None and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert all(p.grad is None for p in stage.parameters())
    assert runner.forward_only([], lambda out, mb: 1) == []
    first = PipelineRunner(_stage("tiny", {}, 0, 2), _fake_groups(2, 0))
    assert first.forward_only([], lambda out, mb: 1) is None  # not the last stage


def test_schedule_errors() -> None:
    mbs, loss_fn = _micro_batches(2)
    stage = _stage("tiny", {}, 1, 2)
    with pytest.raises(ValueError, match="pp group pp\\[0\\] has 1 ranks"):
        PipelineRunner(stage, _fake_groups(1, 0))
    with pytest.raises(ValueError, match="pp index 0 of pp\\[0,1\\] but holds stage 1"):
        PipelineRunner(stage, _fake_groups(2, 0))
    with pytest.raises(ValueError, match="pipeline schedule 'zb' is unknown"):
        PipelineRunner(stage, _fake_groups(2, 1), kind="zb")
    with pytest.raises(ValueError, match="stage 1 of 2 needs the process groups"):
        PipelineRunner(stage)
    runner = PipelineRunner(stage, _fake_groups(2, 1))
    with pytest.raises(ValueError, match="last pipeline stage needs the step's loss function"):
        runner.train(mbs)
    with pytest.raises(ValueError, match="1 micro-batches for 2 pipeline stages"):
        runner.train(mbs[:1], loss_fn)
    with pytest.raises(ValueError, match="module is stage 0/1 but the runner runs stage 1/2"):
        runner.forward_only(mbs, lambda out, mb: None, _stage("tiny", {}, 0, 1))
    state = runner.start(mbs, loss_fn)
    with pytest.raises(ValueError, match="unknown pipeline step"):
        runner.step(state, Op("W", 0))
    state.outputs[0] = paddle.zeros([1])
    with pytest.raises(RuntimeError, match="still in flight"):
        runner.finish(state)
