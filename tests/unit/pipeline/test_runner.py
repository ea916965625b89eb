"""The pipeline runner (`flashcp.pipeline.runner`) run stage by stage in one process.

The transport is replaced by an in-process mailbox and the stages' steps are interleaved in the
order `simulate_plans` derives, so PP = 2 / 3 execution is checked against the sequential model
(bitwise) without launching processes; `tests/integration` does the real one. The loss is the
LM recipe's own (`flashcp.recipes.lm.LMRecipe.loss`), normalised by the step's target count as
the trainer does (`flashcp.recipes.base.normalised`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.config import IGNORE_INDEX, build_config
from flashcp.distributed import comm_stats
from flashcp.models import DEFAULT_LOSS_CHUNK_TOKENS, HeadInput, build_model, preset
from flashcp.pipeline import runner as pipeline_mod
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.pipeline.schedule import Op, build_plans, simulate_plans
from flashcp.pipeline.stage import build_stage
from flashcp.recipes.base import normalised
from flashcp.recipes.lm import LMRecipe
from helpers.fakegroups import pp_groups


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
    runners = [PipelineRunner(st, pp_groups(pp, s), kind=kind) for s, st in enumerate(stages)]
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
    runner = PipelineRunner(stage, pp_groups(1, 0) if with_groups else None)
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
    first = PipelineRunner(_stage("tiny", {}, 0, 2), pp_groups(2, 0))
    assert first.forward_only([], lambda out, mb: 1) is None  # not the last stage


def test_schedule_errors() -> None:
    mbs, loss_fn = _micro_batches(2)
    stage = _stage("tiny", {}, 1, 2)
    with pytest.raises(ValueError, match="pp group pp\\[0\\] has 1 ranks"):
        PipelineRunner(stage, pp_groups(1, 0))
    with pytest.raises(ValueError, match="pp index 0 of pp\\[0,1\\] but holds stage 1"):
        PipelineRunner(stage, pp_groups(2, 0))
    with pytest.raises(ValueError, match="pipeline schedule 'zb' is unknown"):
        PipelineRunner(stage, pp_groups(2, 1), kind="zb")
    with pytest.raises(ValueError, match="stage 1 of 2 needs the process groups"):
        PipelineRunner(stage)
    runner = PipelineRunner(stage, pp_groups(2, 1))
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


def test_a_detached_loss_is_refused_before_backward() -> None:
    """Paddle's backward() on a tensor cut off from the graph does nothing: a rank would skip
    the backward's collectives and its peers would hang. The runner refuses it, named."""
    from flashcp.pipeline.runner import DetachedLossError

    mbs, loss_fn = _micro_batches(2)
    runner = PipelineRunner(_stage("tiny", {}, 0, 1))

    def detached(out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, list[float]]:
        loss, stats = loss_fn(out, mb)
        return (loss.detach() if mb is mbs[1] else loss), stats

    with pytest.raises(DetachedLossError, match="micro-batch 1 .* does not depend on the model"):
        runner.train(mbs, detached)
    # zeros computed from the hidden states are a loss like any other
    losses, _ = runner.train(mbs, lambda out, mb: (loss_fn(out, mb)[0] * 0.0, [0.0]))
    assert losses == [0.0, 0.0]
