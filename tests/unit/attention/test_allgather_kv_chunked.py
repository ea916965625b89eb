"""Chunked all-gather-KV attention (`attention.query_chunk` / `attention.kv_chunk`) in one
process: the same attention as the unchunked implementation and the dense float64 oracle,
within `bench.numerics`'s rule, for every mask family and chunk shapes that do and do not
divide the sequence; the LSE merge exactly (and a merge without the LSE rescale rejected);
rows without keys under both kernel conventions (-inf CPU / FA4, +inf FA2 / FA3); the model
under every recompute mode and with tiling; the registry cut and the config's refusals.

Multi-process parity (CP = 2 and 4 over gloo, per rank, every CP mode) is in
tests/integration/test_attention_chunked_multiproc.py.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from bench import numerics
from flashcp import mask_families, masks
from flashcp.attention import allgather_kv_chunked as chunked
from flashcp.attention import registry
from flashcp.attention.allgather_kv import ALLGATHER_KV
from flashcp.attention.allgather_kv_chunked import ALLGATHER_KV_CHUNKED, key_order, merge_partial
from flashcp.attention.context import AttentionContext
from flashcp.config import load_config
from flashcp.cp.layout import Assignment, chunk_bounds
from flashcp.cp.rebase import rebase_rows, rebase_thresholds
from flashcp.kernels.registry import get_backend
from flashcp.models import build_model, preset
from flashcp.problems import ProblemsError
from helpers.paths import ROOT
from helpers.reference import compare_attention, dense_reference

B, S, HQ, HKV, D = 2, 48, 4, 2, 8
FAMILIES = ("causal", "causal_document", "share_question", "sliding_window", "document",
            "qk_sparse", "random_eviction")  # fmt: skip
CHUNKS = [(16, 0), (0, 16), (13, 24), (7, 5), (48, 48)]


def _inputs(seed: int = 0, seq: int = S):
    rng = np.random.default_rng(seed)
    shapes = [(B, seq, HQ, D), (B, seq, HKV, D), (B, seq, HKV, D), (B, seq, HQ, D)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _mask(family: str, seq: int = S):
    heads = HKV if family == "random_eviction" else 1
    return mask_families.FAMILIES[family](B, seq, heads, 3)


def _run(impl, ctx, q, k, v, dout):
    tq, tk, tv = (paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v))
    out, lse = impl.apply_with_lse(tq, tk, tv, ctx.plan(impl, tq, tk, tv))
    out.backward(paddle.to_tensor(dout))
    return out.numpy(), lse.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def _units(got, want) -> float:
    return max(c.units for c in compare_attention(got, want))


@pytest.mark.equivalence
@pytest.mark.parametrize(("query_chunk", "kv_chunk"), CHUNKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_matches_unchunked_and_dense(family: str, query_chunk: int, kv_chunk: int):
    q, k, v, dout = _inputs()
    mask = _mask(family)
    ctx = AttentionContext(
        mask=mask.indices, causal=mask.causal, query_chunk=query_chunk, kv_chunk=kv_chunk
    )
    impl = registry.implementation_for(ctx)
    assert impl is ALLGATHER_KV_CHUNKED
    got = _run(impl, ctx, q, k, v, dout)
    plain = AttentionContext(mask=mask.indices, causal=mask.causal)
    unchunked = _run(ALLGATHER_KV, plain, q, k, v, dout)
    dense = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
    for want in (unchunked, dense):
        bad = [c.describe() for c in compare_attention(got, want) if not c.ok]
        assert not bad, "\n".join(bad)


def test_negative_control_merge_without_lse_rescale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Averaging the key chunks' outputs (no LSE weights) must fail the same comparison."""
    q, k, v, dout = _inputs()
    mask = _mask("causal_document")
    want = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)

    def naive(acc, out, lse):
        out = out.astype("float32")
        if acc is None:
            return out, lse
        return (acc[0] + out) / 2, paddle.maximum(acc[1], lse)

    monkeypatch.setattr(chunked, "merge_partial", naive)
    ctx = AttentionContext(mask=mask.indices, causal=True, query_chunk=16, kv_chunk=16)
    got = _run(ALLGATHER_KV_CHUNKED, ctx, q, k, v, dout)
    numerics.assert_rejects(got[0], want[0], n=S, what="out, merged without the LSE")


# ------------------------------------------------------------------------------ the merge


def _logsumexp(*xs: np.ndarray) -> np.ndarray:
    stack = np.stack(xs).astype(np.float64)
    top = np.max(stack, axis=0)
    safe = np.where(np.isfinite(top), top, 0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(stack - safe).sum(axis=0))


@pytest.mark.parametrize("empty", [-np.inf, np.inf])
def test_merge_partial_is_exact_and_ignores_empty_rows(empty: float) -> None:
    """Two chunks' (out, lse) merge to the softmax over their union; a row without keys in
    one chunk (LSE `empty`: -inf on CPU / FA4, +inf on FA2 / FA3) takes the other's alone;
    a row without keys in both stays out 0, LSE -inf."""
    rng = np.random.default_rng(0)
    o1, o2 = (rng.standard_normal((1, 5, 2, 3)).astype(np.float32) for _ in range(2))
    l1, l2 = (rng.standard_normal((1, 2, 5)).astype(np.float32) * 3 for _ in range(2))
    l1[0, :, 1] = empty  # row 1: no keys in chunk 1
    o1[0, 1] = 0
    l1[0, :, 4] = l2[0, :, 4] = empty  # row 4: no keys anywhere
    o1[0, 4] = o2[0, 4] = 0
    out, lse = merge_partial(None, paddle.to_tensor(o1), paddle.to_tensor(l1))
    out, lse = merge_partial((out, lse), paddle.to_tensor(o2), paddle.to_tensor(l2))
    n1 = np.where(np.isfinite(l1), l1, -np.inf)
    n2 = np.where(np.isfinite(l2), l2, -np.inf)
    want_lse = _logsumexp(n1, n2)
    with np.errstate(invalid="ignore"):
        w1 = np.nan_to_num(np.exp(n1 - want_lse)).transpose(0, 2, 1)[..., None]
        w2 = np.nan_to_num(np.exp(n2 - want_lse)).transpose(0, 2, 1)[..., None]
    want_out = o1 * w1 + o2 * w2
    numerics.assert_close(lse.numpy(), want_lse, n=2)
    numerics.assert_close(out.numpy(), want_out, n=2)
    assert np.all(lse.numpy()[0, :, 4] == -np.inf) and np.all(out.numpy()[0, 4] == 0)


def _rows_without_keys_mask(seq: int = S) -> np.ndarray:
    """Non-causal `[LTS, UTE]`: every column masks rows [0, 4) — those rows see no key."""
    idx = np.zeros((B, 1, seq, 2), dtype=np.int32)
    idx[..., 0] = seq
    idx[..., 1] = 4
    return idx


class _PlusInfEmpty:
    """The CPU kernel with FA2/FA3's convention for a row without keys: LSE +inf."""

    def __init__(self, real) -> None:
        self.real, self.name = real, "plus-inf-empty"

    def forward(self, *args, **kwargs):
        out, lse = self.real.forward(*args, **kwargs)
        return out, paddle.where(paddle.isfinite(lse), lse, paddle.full_like(lse, np.inf))

    def backward(self, q, k, v, out, lse, *args, **kwargs):
        return self.real.backward(q, k, v, out, lse, *args, **kwargs)


@pytest.mark.parametrize("convention", ["minus", "plus"])
def test_rows_without_keys_keep_the_kernels_convention(monkeypatch, convention: str) -> None:
    q, k, v, dout = _inputs()
    idx = _rows_without_keys_mask()
    want = dense_reference(q, k, v, dout, idx, causal=False)
    if convention == "plus":
        monkeypatch.setattr(chunked, "get_backend", lambda *a: _PlusInfEmpty(get_backend(*a)))
    ctx = AttentionContext(mask=idx, causal=False, query_chunk=10, kv_chunk=12)
    got = _run(ALLGATHER_KV_CHUNKED, ctx, q, k, v, dout)
    lse = got[1]
    assert np.all(lse[:, :, :4] == (np.inf if convention == "plus" else -np.inf))
    assert np.all(got[0][:, :4] == 0) and np.all(got[2][:, :4] == 0)
    if convention == "minus":
        assert _units(got, want) <= numerics.FACTOR
    else:  # the rest equals the oracle; the empty rows carry +inf where the oracle has -inf
        finite = (got[0], lse[:, :, 4:], got[2], got[3], got[4])
        wanted = (want[0], want[1][:, :, 4:], want[2], want[3], want[4])
        assert _units(finite, wanted) <= numerics.FACTOR


# ----------------------------------------------------------------------- plan pieces


def test_key_order_and_chunk_masks_are_column_subsets() -> None:
    """Each key chunk's mask is the rebased mask's columns at the chunk's global positions,
    its rows rebased onto the query chunk (`rebase_rows` = `rebase_thresholds` on a range)."""
    world, seq = 2, 32
    asg = Assignment.dualchunk(world)
    order = key_order(asg, seq, world, 3)
    assert sorted(order.tolist()) == list(range(seq))
    first = np.concatenate([asg.positions(seq, r)[0:3] for r in range(world)])
    np.testing.assert_array_equal(order[: 3 * world], first)
    t = np.random.default_rng(0).integers(0, 17, (1, 1, 20, 4)).astype(np.int32)
    for a, b in [(0, 16), (5, 11), (16, 16)]:
        np.testing.assert_array_equal(
            rebase_rows(t, a, b), rebase_thresholds(t, np.arange(a, b, dtype=np.int64))
        )
        tensor = rebase_rows(paddle.to_tensor(t), a, b)
        assert tensor.dtype == paddle.int32
        np.testing.assert_array_equal(tensor.numpy(), rebase_rows(t, a, b))
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_plan_refuses_a_kv_chunk_that_does_not_split_over_the_ranks(monkeypatch) -> None:
    class Two:
        nranks, rank = 2, 0

    q, k, v, _ = _inputs()
    ctx = AttentionContext(mask=_mask("causal").indices, causal=True, kv_chunk=7)
    monkeypatch.setattr(AttentionContext, "uses_cp", property(lambda self: True))
    ctx.group = Two()
    with pytest.raises(ValueError, match="attention.kv_chunk 7 is not a multiple"):
        ALLGATHER_KV_CHUNKED.plan(paddle.to_tensor(q[:, :24]), paddle.to_tensor(k[:, :24]),
                                  paddle.to_tensor(v[:, :24]), ctx)  # fmt: skip


def test_no_mask_causal_builds_the_causal_mask() -> None:
    q, k, v, dout = _inputs()
    ctx = AttentionContext(mask=None, causal=True, query_chunk=8, kv_chunk=8)
    got = _run(ALLGATHER_KV_CHUNKED, ctx, q, k, v, dout)
    want = dense_reference(q, k, v, dout, None, causal=True)
    assert _units(got, want) <= numerics.FACTOR
    with pytest.raises(ValueError, match="needs a mask or causal=True"):
        _run(ALLGATHER_KV_CHUNKED, AttentionContext(mask=None, causal=False, kv_chunk=8),
             q, k, v, dout)  # fmt: skip


# ------------------------------------------------------------------- in the model


def _model_step(mode: str, ctx_kwargs: dict, tile: int = 0):
    model = build_model(preset("tiny_glm", recompute=mode, tile_tokens=tile), seed=0)
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, 260, (B, 32)), dtype="int64")
    pos = paddle.arange(32, dtype="int64").unsqueeze(0).expand([B, 32])
    mask = masks.causal_document_mask([11, 21], batch=B).indices
    ctx = AttentionContext(mask=mask, causal=True, **ctx_kwargs)
    loss = F.cross_entropy(model.logits(model(ids, pos, ctx)), ids.unsqueeze(-1)).mean()
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


@pytest.mark.equivalence
@pytest.mark.parametrize("tile", [0, 8])
@pytest.mark.parametrize("mode", ["none", "full", "refined"])
def test_model_with_chunked_attention(mode: str, tile: int) -> None:
    """Every recompute mode (the chunked plan pinned and replayed), with and without tiling."""
    loss0, g0 = _model_step(mode, {})
    loss, g = _model_step(mode, {"query_chunk": 8, "kv_chunk": 12}, tile)
    numerics.assert_close(loss, loss0, n=B * 32, scale=loss0)
    assert g.keys() == g0.keys()
    for key in g0:
        norm = float(np.linalg.norm(g0[key]))
        numerics.assert_close(g[key], g0[key], n=B * 32, scale=norm, norm="l2", what=key)


# ----------------------------------------------------------------- registry and config


def test_registry_names_the_chunked_implementation_of_every_mode() -> None:
    for name in registry.names():
        assert registry.get(name).chunked_implementation == registry.ALLGATHER_KV_CHUNKED
        assert registry.chunked_implementation(name) is ALLGATHER_KV_CHUNKED
    ctx = AttentionContext(mask=None, causal=True)
    assert not ctx.chunked and registry.implementation_for(ctx).name == "local"


def test_a_mode_without_chunked_attention_is_refused() -> None:
    other = registry.CPMode("ring_like", 1, lambda w, c, m, k: Assignment.contiguous(w),
                            implementation="flashcp.attention.local:LOCAL")  # fmt: skip
    registry.register(other)
    try:
        assert other.chunked_implementation is None
        with pytest.raises(ValueError, match="has no chunked attention"):
            registry.implementation_for(AttentionContext(None, True, mode="ring_like",
                                                         query_chunk=4))  # fmt: skip
        with pytest.raises(ProblemsError) as info:
            load_config(ROOT / "configs/gpt/tiny_cp2.yaml",
                        ["parallel.cp_mode=ring_like", "attention.query_chunk=8"])  # fmt: skip
        assert "attention.query_chunk" in str(info.value)
    finally:
        del registry.MODES["ring_like"]


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["attention.kv_chunk=7"], "attention.kv_chunk", "multiple of parallel.cp = 2"),
        (["attention.query_chunk=-1"], "attention.query_chunk", ">= 0"),
        (["attention.kv_chunk=-2"], "attention.kv_chunk", ">= 0"),
    ],
)
def test_config_refuses_bad_chunks(overrides, key, words) -> None:
    with pytest.raises(ProblemsError) as info:
        load_config(ROOT / "configs/gpt/tiny_cp2.yaml", overrides)
    assert key in str(info.value) and words in str(info.value), str(info.value)


def test_config_carries_the_chunks() -> None:
    cfg = load_config(ROOT / "configs/gpt/tiny_cp2.yaml",
                      ["attention.query_chunk=64", "attention.kv_chunk=128"])  # fmt: skip
    assert (cfg.attention.query_chunk, cfg.attention.kv_chunk) == (64, 128)
