"""The LM recipe with trained MTP layers (`model.mtp_loss_weight` > 0): its loss is the main
cross-entropy plus λ/D times the depths' summed cross-entropy, its statistics count the MTP
targets the definition gives (checked against a position-by-position loop, not the vectorised
`mtp_targets`), the chunked MTP head equals the unchunked one, and `finish` reports
`lm_loss` / `mtp_loss`. Without a weight nothing of MTP is computed or reported."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.config import IGNORE_INDEX, build_config
from flashcp.data.packing import PackedSequence, collate
from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups
from flashcp.models import HeadInput, build_model
from flashcp.pipeline.runner import MicroBatch
from flashcp.recipes.lm import LMRecipe

DEPTHS, WEIGHT, SEQ = 2, 0.4, 24


def _solo() -> ParallelGroups:
    solo = NamedGroup("pp", 0, -1, [0], pg=None)
    return ParallelGroups(ParallelDims(dp=1, pp=1, cp=1, world_size=1), 0, solo, solo, solo,
                          solo, "none")  # fmt: skip


def _batch() -> object:
    """Two rows of packed documents (an sft-style prompt in row 0), one with padding."""
    rng = np.random.default_rng(3)
    rows = []
    for lens in ([9, 5, 10], [13, 11]):
        tokens = rng.integers(0, 250, SEQ).astype(np.int64)
        targets = np.ones(SEQ, dtype=bool)
        targets[:4] = False  # a prompt: no target
        rows.append(PackedSequence(tokens, targets, lens))
    return collate(rows)


def _loop_targets(labels: np.ndarray, doc_lens: list[list[int]], depth: int) -> np.ndarray:
    """The definition, one position at a time: depth d at i predicts token i+d+1 = labels[i+d]
    when i and i+d lie in the same document."""
    out = np.full_like(labels, IGNORE_INDEX)
    for row, lens in enumerate(doc_lens):
        doc = [k for k, n in enumerate(lens) for _ in range(n)]
        for i in range(labels.shape[1] - depth):
            if doc[i] == doc[i + depth]:
                out[row, i] = labels[row, i + depth]
    return out


def _setup(weight: float, chunk: int = 0):
    cfg = build_config({
        "model": {"preset": "tiny_glm_moe", "mtp_layers": DEPTHS, "mtp_loss_weight": weight},
        "train": {"loss_chunk_tokens": chunk},
    })  # fmt: skip
    paddle.seed(0)
    model = build_model(cfg.model, seed=0)
    return cfg, model, LMRecipe(cfg, _solo())


def _loss(model, recipe, mtp_depth: int):
    batch = _batch()
    mb = MicroBatch.of(batch, None, mtp_depth=mtp_depth)
    hidden = model(mb.input_ids, mb.positions, mb.attn)
    loss, stats = recipe.loss(HeadInput(hidden, model), mb)
    return batch, mb, hidden, loss, [float(s) for s in stats]


def test_mtp_targets_match_the_definition_and_the_loss_composes() -> None:
    cfg, model, recipe = _setup(WEIGHT)
    batch, mb, hidden, loss, stats = _loss(model, recipe, DEPTHS)
    assert mb.mtp_labels is not None and mb.mtp_ids is not None
    for d in range(1, DEPTHS + 1):
        want = _loop_targets(batch.labels, batch.doc_lens, d)
        np.testing.assert_array_equal(mb.mtp_labels.numpy()[d - 1], want)
        ids = mb.mtp_ids.numpy()[d - 1]
        np.testing.assert_array_equal(ids[:, : SEQ - d], batch.input_ids[:, d:])
    # negative control: one position too few (the main labels, document-masked) is caught
    shifted = _loop_targets(batch.labels, batch.doc_lens, 0)
    assert not np.array_equal(mb.mtp_labels.numpy()[0], shifted)
    assert recipe.stats == ("nll", "targets", "mtp_nll", "mtp_targets")
    n_mtp = sum(int((_loop_targets(batch.labels, batch.doc_lens, d) != IGNORE_INDEX).sum())
                for d in (1, 2))  # fmt: skip
    assert stats[3] == n_mtp and 0 < n_mtp < 2 * stats[1]
    # the parts, computed unchunked through the model's own heads
    main = -float(HeadInput(hidden, model).token_logprobs(mb.labels, chunk_tokens=0).sum())
    logps = model.mtp_token_logprobs(hidden, mb.mtp_ids, mb.mtp_labels, mb.positions, mb.attn,
                                     chunk_tokens=0)  # fmt: skip
    mtp = -sum(float(lp.sum()) for lp in logps)
    assert stats[0] == pytest.approx(main, rel=1e-6) and stats[2] == pytest.approx(mtp, rel=1e-6)
    assert float(loss) == pytest.approx(main + WEIGHT / DEPTHS * mtp, rel=1e-6)
    # ignored targets contribute exactly 0 at every depth
    for lp, labels in zip(logps, mb.mtp_labels.numpy(), strict=True):
        assert not lp.numpy()[labels == IGNORE_INDEX].any()
        assert (lp.numpy()[labels != IGNORE_INDEX] < 0).all()
    metrics = recipe.finish(stats)
    assert metrics["lm_loss"] == metrics["loss"] == pytest.approx(main / stats[1])
    assert metrics["mtp_loss"] == pytest.approx(mtp / n_mtp)
    assert math.isclose(metrics["mtp_loss"], math.log(cfg.model.vocab_size), rel_tol=0.1)
    # the gradient reaches the MTP layers and, through hnorm, the main model
    loss.backward()
    n = cfg.model.num_layers
    names = (f"model.layers.{n}.eh_proj.weight", f"model.layers.{n + 1}.shared_head.head.weight",
             f"model.layers.{n}.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")
    for name in names:
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and float(grad.abs().sum()) > 0, name


def test_chunked_mtp_head_equals_unchunked() -> None:
    _, model, recipe = _setup(WEIGHT, chunk=0)
    _, _, _, want, want_stats = _loss(model, recipe, DEPTHS)
    _, model, recipe = _setup(WEIGHT, chunk=7)  # several chunks per depth
    _, _, _, got, got_stats = _loss(model, recipe, DEPTHS)
    # sums of per-token cross-entropies (all positive: scale = the sum) over the targets; the
    # chunks may round a row differently where the BLAS picks kernels by row count
    targets = want_stats[1] + want_stats[3]
    assert abs(float(got) - float(want)) <= numerics.tolerance(targets, float(want))
    for g, w in zip(got_stats, want_stats, strict=True):
        assert abs(g - w) <= numerics.tolerance(targets, abs(w))


def test_without_a_weight_no_mtp_is_computed_or_reported() -> None:
    _, model, recipe = _setup(0.0)
    assert recipe.stats == ("nll", "targets") and recipe.step_metrics == ()
    _, mb, hidden, loss, stats = _loss(model, recipe, 0)
    assert mb.mtp_ids is None and len(stats) == 2
    assert float(loss) == pytest.approx(stats[0])
    assert "mtp_loss" not in recipe.finish(stats)
    # a trained recipe handed a micro-batch without MTP targets says so
    _, model, trained = _setup(WEIGHT)
    with pytest.raises(ValueError, match="no MTP targets"):
        trained.loss(HeadInput(hidden, model), mb)
