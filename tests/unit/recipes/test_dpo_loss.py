"""DPO losses (cross-checked against PaddleFormers) and answer log-prob span sums."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddleformers.nn.criterion import dpo_loss as pf_dpo

from bench import numerics
from flashcp.cp.layout import Assignment, assigned_positions, shard_assigned
from flashcp.data.dpo_packing import pack_dpo
from flashcp.data.dpo_records import DPOExample
from flashcp.models import token_logprobs
from flashcp.recipes.dpo_loss import dpo_loss, sequence_logps


def _logps(seed: int = 0, n: int = 8) -> list[paddle.Tensor]:
    rng = np.random.default_rng(seed)
    return [paddle.to_tensor(rng.normal(-60.0, 8.0, n).astype("float32")) for _ in range(4)]


def _pf_self(loss_type: str, beta: float, label_smoothing: float) -> SimpleNamespace:
    """The minimal `self` PaddleFormers' criterion functions read (its `dpo_config` fields)."""
    dpo_config = SimpleNamespace(
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        offset_alpha=0.0,
        pref_loss_ratio=1.0,
        ignore_eos_token=False,
        normalize_logps=False,
        sft_loss_ratio=0.0,
    )
    return SimpleNamespace(
        dpo_config=dpo_config,
        use_filtered_label_loss=False,
        use_fused_head_and_loss_fn=False,
        use_subbatch=False,
        tie_word_embeddings=False,
        config=SimpleNamespace(tensor_model_parallel_size=1, sequence_parallel=False),
        loss_func=lambda logits, labels: F.cross_entropy(
            logits, labels, reduction="none", ignore_index=-100
        ),
    )


@pytest.mark.parametrize(
    ("loss_type", "beta", "ls"),
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("hinge", 0.1, 0.0)],
)
def test_loss_matches_paddleformers_cal_dpo_loss(loss_type: str, beta: float, ls: float) -> None:
    """flashcp's loss == `paddleformers.nn.criterion.dpo_loss.cal_dpo_loss` on the same inputs."""
    pc, pr, rc, rr = _logps()
    pc.stop_gradient = False
    ours, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=ls)
    ref = pf_dpo.cal_dpo_loss(_pf_self(loss_type, beta, ls), pc, pr, rc, rr, None)
    # Two float32 computations of the mean over the N pairs of ℓ(h), h = (π_c - π_r) -
    # (ρ_c - ρ_r) a small difference of log-probs of ~-60: the float32 rule (bench.numerics),
    # n = N, scale = what the loss's rounding scales with, Σ_i |∂L/∂h_i|·Σ|log-probs of pair i|
    # (∂L/∂h_i = ∂L/∂π_c,i; h's rounding) plus |L| (the loss's own)
    ours.backward()
    magnitude = sum(np.abs(t.numpy().astype(np.float64)) for t in (pc, pr, rc, rr))
    scale = float(np.abs(pc.grad.numpy()) @ magnitude) + abs(float(ours))
    n = int(pc.shape[0])
    numerics.assert_close(float(ours), float(ref), n=n, scale=scale, what=loss_type)
    # negative control: the reference's log-probs left out of h
    zero = paddle.zeros_like(rc)
    wrong, _ = dpo_loss(pc, pr, zero, zero, beta=beta, loss_type=loss_type, label_smoothing=ls)
    numerics.assert_rejects(float(wrong), float(ref), n=n, scale=scale)


def test_sigmoid_formula_and_metrics() -> None:
    pc, pr = np.array([-10.0, -20.0, -5.0]), np.array([-12.0, -15.0, -5.0])
    rc, rr = np.array([-11.0, -18.0, -6.0]), np.array([-11.0, -16.0, -6.0])
    beta = 0.5
    loss, m = dpo_loss(
        *(paddle.to_tensor(x.astype("float32")) for x in (pc, pr, rc, rr)), beta=beta
    )
    h = (pc - pr) - (rc - rr)
    np.testing.assert_allclose(float(loss), np.mean(np.log1p(np.exp(-beta * h))), rtol=1e-6)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    np.testing.assert_allclose(float(m["rewards/chosen"]), chosen.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["rewards/rejected"]), rejected.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["rewards/margin"]), (chosen - rejected).mean(), rtol=1e-6)
    assert float(m["rewards/accuracy"]) == pytest.approx(np.mean(chosen > rejected))


def test_gradient_flows_to_policy_only() -> None:
    pc, pr, rc, rr = _logps(n=4)
    for t in (pc, pr, rc, rr):
        t.stop_gradient = False
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.1)
    loss.backward()
    assert pc.grad is not None and pr.grad is not None
    assert rc.grad is None and rr.grad is None  # the reference is a constant
    assert all(v.stop_gradient for v in metrics.values())
    # d loss / d pi_c = -beta * sigmoid(-beta h) / N
    h = (pc - pr - rc + rr).numpy()
    expect = -0.1 * (1 / (1 + np.exp(0.1 * h))) / 4
    np.testing.assert_allclose(pc.grad.numpy(), expect, rtol=1e-5)


def test_loss_argument_errors() -> None:
    v = _logps(n=3)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(*v, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(*v, beta=0.0)
    with pytest.raises(ValueError, match="sigmoid loss only"):
        dpo_loss(*v, beta=0.1, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(*v[:3], paddle.zeros([2]), beta=0.1)


# ------------------------------------------------------------------------------ span sums


def _packed_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    exs = []
    for p, c, r in [(5, 4, 3), (3, 6, 2), (4, 2, 5), (2, 3, 3)]:
        t = [int(x) for x in rng.integers(0, 30, p + c + r)]
        exs.append(DPOExample(tuple(t[:p]), tuple(t[p : p + c]), tuple(t[p + c :])))
    batch = pack_dpo(exs, 24, pad_id=31)
    logits = paddle.to_tensor(rng.normal(size=(*batch.shape, 32)).astype("float32"))
    return batch, logits


def test_sequence_logps_matches_paddleformers_dpo_logps() -> None:
    """Span sums == PaddleFormers' `dpo_logps` with its `response_indexs` format."""
    batch, logits = _packed_case()
    labels = paddle.to_tensor(batch.labels)
    ours_c, ours_r = sequence_logps(token_logprobs(logits, labels), batch.spans)
    ref_c, ref_r, _ = pf_dpo.dpo_logps(
        _pf_self("sigmoid", 0.1, 0.0), logits, labels, paddle.to_tensor(batch.response_indexs())
    )
    # two float32 sums of the same answer tokens' log-probs: the float32 rule, n = the row,
    # scale = |sum| (the log-probs all share a sign), as in the CP shard test below
    seq = batch.shape[1]
    numerics.assert_close(ours_c.numpy(), ref_c.numpy(), n=seq, what="chosen")
    numerics.assert_close(ours_r.numpy(), ref_r.numpy(), n=seq, what="rejected")
    # negative control: chosen and rejected answers swapped
    numerics.assert_rejects(ours_r.numpy(), ref_c.numpy(), n=seq)


def test_sequence_logps_sums_average_and_grad() -> None:
    batch, logits = _packed_case(1)
    token_lp = token_logprobs(logits, paddle.to_tensor(batch.labels))
    token_lp.stop_gradient = False
    c, r = sequence_logps(token_lp, batch.spans)
    lp = token_lp.numpy()
    for n in range(batch.num_examples):
        (row, cs, ce), (_, rs, re_) = batch.spans[n]
        assert float(c[n]) == pytest.approx(lp[row, cs:ce].sum(), rel=1e-6)
        assert float(r[n]) == pytest.approx(lp[row, rs:re_].sum(), rel=1e-6)
    (c.sum() + 2 * r.sum()).backward()
    weight = np.zeros(batch.shape)
    for (row, cs, ce), (_, rs, re_) in batch.spans:
        weight[row, cs:ce], weight[row, rs:re_] = 1.0, 2.0
    np.testing.assert_array_equal(token_lp.grad.numpy(), weight)
    ca, _ = sequence_logps(token_lp, batch.spans, average=True)
    lens = batch.spans[:, 0, 2] - batch.spans[:, 0, 1]
    np.testing.assert_allclose(ca.numpy(), c.numpy() / lens, rtol=1e-6)


@pytest.mark.equivalence
def test_sequence_logps_cp_shards_add_up() -> None:
    """Per-rank partial sums over a CP shard's global columns add up to the full sums."""
    batch, logits = _packed_case(2)
    token_lp = token_logprobs(logits, paddle.to_tensor(batch.labels))
    full_c, full_r = sequence_logps(token_lp, batch.spans)
    assignment = Assignment.dualchunk(2)
    seq = batch.shape[1]
    parts = []
    for rank in range(2):
        local = shard_assigned(token_lp, rank, assignment, axis=1)
        cols = assigned_positions(seq, rank, assignment)
        parts.append(sequence_logps(local, batch.spans, columns=cols))
    # the same token sums split in two: the float32 rule (bench.numerics), n = the row,
    # scale = |sum| (the log-probs all share a sign)
    numerics.assert_close(sum(p[0].numpy() for p in parts), full_c.numpy(), n=seq, what="c")
    numerics.assert_close(sum(p[1].numpy() for p in parts), full_r.numpy(), n=seq, what="r")
    # negative control: one rank's share alone is not the sum
    numerics.assert_rejects(parts[0][0].numpy(), full_c.numpy(), n=seq)


def test_sequence_logps_missing_answer_and_bad_spans() -> None:
    token_lp = paddle.ones([2, 6])
    c, r = sequence_logps(token_lp, [[[0, 1, 4], [-1, 0, 0]]])
    assert float(c[0]) == 3.0 and float(r[0]) == 0.0
    with pytest.raises(ValueError, match="overlaps another span"):
        sequence_logps(token_lp, [[[0, 1, 4], [0, 3, 5]]])
    with pytest.raises(ValueError, match="outside the"):
        sequence_logps(token_lp, [[[2, 1, 4], [0, 4, 5]]])
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        sequence_logps(paddle.ones([6]), [[[0, 1, 4], [0, 4, 5]]])


def test_sequence_logps_without_local_answer_tokens_stays_on_the_graph() -> None:
    """A cp rank whose chunks hold no answer token (only prompts) returns zero sums that still
    depend on the log-probs: its loss back-propagates through the model like its peers' (a
    detached constant made backward a no-op there, and the peers hung in the attention's
    reduce-scatter, issue 31)."""
    token_lp = paddle.randn([1, 4])  # this rank's shard: global columns 0..3 of 8
    token_lp.stop_gradient = False
    spans = [[[0, 5, 7], [0, 7, 8]]]
    c, r = sequence_logps(token_lp, spans, columns=np.arange(4))
    assert c.numpy().tolist() == [0.0] and r.numpy().tolist() == [0.0]
    assert not c.stop_gradient and not r.stop_gradient
    (c.sum() + r.sum()).backward()
    np.testing.assert_array_equal(token_lp.grad.numpy(), np.zeros([1, 4], np.float32))
