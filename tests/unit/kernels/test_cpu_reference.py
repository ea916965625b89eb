"""The CPU reference FlashMask kernel through the front door, against a dense float64 oracle.

The oracle here is written independently of the kernel: a dense `softmax(Q Kᵀ·scale + M)·V`
per head in float64, with M from `mask_indices.to_dense`, and hand-derived gradients (themselves
cross-checked once against Paddle autograd). Every mask family, GQA/MQA, per-head masks,
Sq != Sk, odd sizes and small tile sizes are compared for float32 inputs under the float32
rule of `bench.numerics` (reductions over the query / key / head dimension, scale = each
array's max |value|); float64 inputs to 1e-12.
"""

from __future__ import annotations

import zlib

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import numerics
from flashcp import fa_dispatch, mask_families, mask_indices, masks
from flashcp.attention import interface, local
from flashcp.attention.flashmask import flashmask_attention, flashmask_attention_with_version
from flashcp.kernels import CpuReferenceBackend, registry
from flashcp.kernels.cpu_plan import TilePlan, head_units, heads_first_augmented
from helpers.maskcases import overshoot
from helpers.reference import NAMES, compare_attention, dense_reference

pytestmark = pytest.mark.equivalence  # float32 kernel vs the float64 oracle (bench.numerics)

BLOCKS = [(16, 16), (32, 8)]  # (block_q, block_k): neither divides the odd sizes used


@pytest.fixture(autouse=True)
def _fa2_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """A known FA version (2) on CPU, whatever the calling environment exports."""
    flags = (fa_dispatch.FLAG_VERSION, fa_dispatch.FLAG_DETERMINISTIC, fa_dispatch.ENV_FA4_POLICY)
    for key in flags:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """Run the registry's CPU backend with the given tile sizes."""
    bq, bk, merge = request.param
    backend = CpuReferenceBackend(block_q=bq, block_k=bk, max_merge_cols=merge)
    monkeypatch.setitem(registry._instances, registry.CPU_BACKEND, backend)
    return backend


# ------------------------------------------------------------------------------ oracle


def make_inputs(rng, B, Sq, Sk, Hq, Hkv, D, Dv=None, dtype=np.float32):
    Dv = D if Dv is None else Dv
    return (
        rng.standard_normal((B, Sq, Hq, D)).astype(dtype),
        rng.standard_normal((B, Sk, Hkv, D)).astype(dtype),
        rng.standard_normal((B, Sk, Hkv, Dv)).astype(dtype),
        rng.standard_normal((B, Sq, Hq, Dv)).astype(dtype),
    )


def run_front_door(q, k, v, dout, idx, *, causal, scale=None, **kwargs):
    """Forward + backward through `flashmask_attention`; numpy results."""
    tq, tk, tv = (paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v))
    tidx = None if idx is None else paddle.to_tensor(idx, dtype="int32")
    out, lse = flashmask_attention(
        tq, tk, tv, tidx, causal=causal, softmax_scale=scale, return_lse=True, **kwargs
    )
    out.backward(paddle.to_tensor(dout))
    return out.numpy(), lse.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def assert_matches(got, want, label: str = ""):
    """float32 kernel results vs the float64 oracle under the rule of `bench.numerics`
    (`reference.compare_attention`)."""
    for name, a in zip(NAMES, got, strict=True):
        assert not np.isnan(a).any(), f"{name} has NaN"
    bad = [c.describe() for c in compare_attention(got, want, label=label) if not c.ok]
    assert not bad, "\n".join(bad)


def check(rng, B, Sq, Sk, Hq, Hkv, D, idx, *, causal, scale=None, Dv=None):
    q, k, v, dout = make_inputs(rng, B, Sq, Sk, Hq, Hkv, D, Dv)
    got = run_front_door(q, k, v, dout, idx, causal=causal, scale=scale)
    want = dense_reference(q, k, v, dout, idx, causal=causal, scale=scale)
    assert_matches(got, want)
    return got, want


def random_mask(rng, B, Hm, Sk, Sq, ncol):
    """Random valid indices: ordered pairs in [0, Sq] (ncol 1: any thresholds)."""
    if ncol == 1:
        return rng.integers(0, Sq + 1, (B, Hm, Sk, 1)).astype(np.int32)
    pairs = [np.sort(rng.integers(0, Sq + 1, (B, Hm, Sk, 2)), axis=-1) for _ in range(ncol // 2)]
    return np.concatenate(pairs, axis=-1).astype(np.int32)


# ------------------------------------------------------------------------------ tests


def test_oracle_matches_paddle_autograd() -> None:
    """The hand-written oracle gradients agree with Paddle autograd in float64."""
    rng = np.random.default_rng(0)
    q, k, v, dout = make_inputs(rng, 1, 23, 29, 4, 2, 8, dtype=np.float64)
    idx = random_mask(rng, 1, 2, 29, 23, 4)
    out, _lse, dq, dk, dv = dense_reference(q, k, v, dout, idx, causal=False)
    tq, tk, tv = (paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v))
    dense = mask_indices.to_dense(idx, causal=False, q_len=23)
    bias = np.where(dense, -np.inf, 0.0)  # [1, 2, Sq, Sk]
    bias = paddle.to_tensor(np.repeat(bias, 2, axis=1))  # mask head per KV head -> per q head
    kk = paddle.repeat_interleave(tk, 2, axis=2).transpose([0, 2, 1, 3])
    vv = paddle.repeat_interleave(tv, 2, axis=2).transpose([0, 2, 1, 3])
    s = paddle.matmul(tq.transpose([0, 2, 1, 3]), kk, transpose_y=True) * 8**-0.5 + bias
    o = paddle.matmul(paddle.nn.functional.softmax(s, axis=-1), vv).transpose([0, 2, 1, 3])
    o.backward(paddle.to_tensor(dout))
    for a, b in ((out, o), (dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-12)


@pytest.mark.parametrize("blocks", [(16, 16, 32), (32, 8, 1024)], indirect=True)
@pytest.mark.parametrize("family", sorted(mask_families.FAMILIES))
def test_every_mask_family(family: str, blocks) -> None:
    rng = np.random.default_rng(zlib.crc32(family.encode()))  # stable across processes
    B, S = 2, 75
    mask = mask_families.FAMILIES[family](B, S, 1, 7)
    check(rng, B, S, S, 4, 2, 16, mask.indices, causal=mask.causal)


@pytest.mark.parametrize("family", ["causal_document", "sliding_window_per_head", "document"])
@pytest.mark.parametrize(("hq", "hkv", "hm"), [(4, 2, 2), (4, 2, 4), (4, 1, 4), (4, 1, 1)])
def test_gqa_and_per_head_masks(family: str, hq: int, hkv: int, hm: int) -> None:
    rng = np.random.default_rng(hq * 100 + hkv * 10 + hm)
    mask = mask_families.FAMILIES[family](2, 53, hm, 3)
    check(rng, 2, 53, 53, hq, hkv, 16, mask.indices, causal=mask.causal)


@pytest.mark.parametrize("blocks", [(16, 16, 1024), (8, 16, 16)], indirect=True)
@pytest.mark.parametrize(("sq", "sk"), [(37, 61), (61, 37), (1, 29), (29, 1)])
@pytest.mark.parametrize(("causal", "ncol"), [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_sq_ne_sk(sq: int, sk: int, causal: bool, ncol: int, blocks) -> None:
    """Causal is bottom-right aligned (Sk - Sq offset) and thresholds are rows of Sq."""
    rng = np.random.default_rng(sq * sk + ncol)
    idx = random_mask(rng, 2, 2, sk, sq, ncol)
    if causal and ncol == 1:
        idx = np.maximum(idx, sq // 2).astype(np.int32)  # keep most rows alive
    check(rng, 2, sq, sk, 4, 2, 8, idx, causal=causal)


@pytest.mark.parametrize("blocks", [(16, 16, 1024), (128, 128, 1024)], indirect=True)
@pytest.mark.parametrize(("sq", "sk"), [(37, 37), (40, 23), (23, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_no_mask(sq: int, sk: int, causal: bool, blocks) -> None:
    check(np.random.default_rng(sq + sk), 2, sq, sk, 4, 4, 16, None, causal=causal)


def test_odd_sizes_batch_and_head_dims() -> None:
    """S = 37 with tiles of 16/8, batch 3, Dv != D, custom scale."""
    rng = np.random.default_rng(5)
    mask = mask_families.FAMILIES["global_sliding_window"](3, 37, 1, 11)
    check(rng, 3, 37, 37, 6, 3, 12, mask.indices, causal=mask.causal, Dv=20, scale=0.3)


def test_longer_sequence_with_default_tiles() -> None:
    """S = 300 with the default 128-tiles: FULL, PARTIAL and MASKED tiles all occur."""
    rng = np.random.default_rng(9)
    mask = masks.causal_document_mask([[260, 40]], heads=1)
    plan = TilePlan(mask.indices, batch=1, q_len=300, k_len=300, causal=True)
    assert plan.stats()["masked"] and plan.stats()["partial"] and plan.stats()["full"]
    check(rng, 1, 300, 300, 2, 1, 32, mask.indices, causal=True)


def test_float64_is_exact() -> None:
    rng = np.random.default_rng(2)
    q, k, v, dout = make_inputs(rng, 2, 41, 41, 4, 2, 8, dtype=np.float64)
    mask = mask_families.FAMILIES["share_question"](2, 41, 2, 1)
    got = run_front_door(q, k, v, dout, mask.indices, causal=mask.causal)
    assert got[1].dtype == np.float64
    want = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12, rtol=1e-12, err_msg=name)


def test_fully_masked_rows_and_columns() -> None:
    """Rows >= 20 see nothing; columns >= 30 are seen by nobody: zeros, LSE -inf, no NaN."""
    rng = np.random.default_rng(4)
    S = 37
    idx = np.zeros((1, 1, S, 2), dtype=np.int32)
    idx[..., 0] = 20  # LTS: rows >= 20 masked in every column
    idx[0, 0, 30:, 0] = 0  # columns >= 30 masked for every row
    (out, lse, dq, dk, dv), want = check(rng, 1, S, S, 4, 2, 16, idx, causal=False)
    assert np.all(out[:, 20:] == 0) and np.all(dq[:, 20:] == 0)
    assert np.all(np.isneginf(lse[:, :, 20:])) and np.all(np.isfinite(lse[:, :, :20]))
    assert np.all(dk[:, 30:] == 0) and np.all(dv[:, 30:] == 0)


def test_everything_masked() -> None:
    """(LTS, UTE) = (0, Sq) masks all: all-zero output and grads, LSE -inf."""
    rng = np.random.default_rng(8)
    idx = np.zeros((2, 1, 19, 2), dtype=np.int32)
    idx[..., 1] = 19
    q, k, v, dout = make_inputs(rng, 2, 19, 19, 2, 2, 8)
    out, lse, dq, dk, dv = run_front_door(q, k, v, dout, idx, causal=False)
    assert np.all(np.isneginf(lse))
    for x in (out, dq, dk, dv):
        assert np.all(x == 0)


def test_tolerance_is_meaningful() -> None:
    """A one-column change of the mask, or a one-row shift, fails the comparison."""
    rng = np.random.default_rng(6)
    mask = masks.causal_document_mask([[20, 17]], heads=1)
    q, k, v, dout = make_inputs(rng, 1, 37, 37, 2, 2, 16)
    got = run_front_door(q, k, v, dout, mask.indices, causal=True)
    wrong = mask.indices.copy()
    wrong[0, 0, 5, 0] = 37  # column 5 visible to the second document too
    for bad_idx in (wrong, np.minimum(mask.indices + 1, 37).astype(np.int32)):
        want = dense_reference(q, k, v, dout, bad_idx, causal=True)
        with pytest.raises(AssertionError):
            assert_matches(got, want, label="negative control ")
    # and the wrong reference is off by far more than the allowance (not just beyond it)
    bad = dense_reference(q, k, v, dout, wrong, causal=True)
    numerics.assert_rejects(got[0], bad[0], n=37, margin=100)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.integers(1, 48),
    sk=st.integers(1, 48),
    hkv=st.sampled_from([1, 2]),
    mask_kind=st.sampled_from(["none", "c1", "c2", "n2", "n4"]),
    per_head=st.booleans(),
    bq=st.sampled_from([4, 16, 64]),
    bk=st.sampled_from([4, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_masks(sq, sk, hkv, mask_kind, per_head, bq, bk, seed) -> None:
    """Property: any valid mask / shape / tiling matches the oracle (numpy-level backend)."""
    rng = np.random.default_rng(seed)
    hq = 2 * hkv
    causal = mask_kind in ("c1", "c2")
    idx = None
    if mask_kind != "none":
        idx = random_mask(rng, 1, hq if per_head else 1, sk, sq, int(mask_kind[1]))
    q, k, v, dout = make_inputs(rng, 1, sq, sk, hq, hkv, 8)
    backend = CpuReferenceBackend(block_q=bq, block_k=bk, max_merge_cols=2 * bk)
    out, lse = backend.forward(q, k, v, idx, causal=causal, softmax_scale=None)
    grads = backend.backward(q, k, v, out, lse, idx, dout, causal=causal, softmax_scale=None)
    want = dense_reference(q, k, v, dout, idx, causal=causal)
    assert_matches((out, lse, *grads), want)


# ------------------------------------------------------------------------------ tiling


def test_tiles_masked_skipped_full_unmasked_partial_small() -> None:
    """Only PARTIAL tiles build a mask, never bigger than one tile run; MASKED never visited."""
    mask = masks.causal_document_mask([[64, 64, 64, 64]], heads=1)
    plan = TilePlan(
        mask.indices, batch=1, q_len=256, k_len=256, causal=True, block_q=32, block_k=32
    )
    shapes: list[tuple[int, int]] = []
    original = plan.tile_mask

    def spy(b, m, r0, r1, c0, c1):
        shapes.append((r1 - r0, c1 - c0))
        return original(b, m, r0, r1, c0, c1)

    plan.tile_mask = spy  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    q, k, v, _ = make_inputs(rng, 1, 256, 256, 2, 2, 8)
    from flashcp.kernels.cpu_forward import flash_forward

    flash_forward(q, k, v, plan, 8**-0.5)
    stats = plan.stats()
    assert len(shapes) == stats["partial"] == 8  # the diagonal tiles only
    assert all(r <= 32 and c <= 32 for r, c in shapes)
    visited = sum(seg.k1 - seg.k0 for i in range(8) for seg in plan.segments(0, 0, i))
    assert visited == 32 * 32 * (1 + 2) * 4 // 32  # per document: 1 + 2 tiles of 32 columns
    # no mask at all: not one tile mask is built
    plan2 = TilePlan(None, batch=1, q_len=256, k_len=256, causal=False, block_q=32, block_k=32)
    plan2.tile_mask = lambda *a: pytest.fail("FULL tiles must not build masks")  # type: ignore
    flash_forward(q, k, v, plan2, 8**-0.5)


def test_merge_cap_bounds_segments() -> None:
    plan = TilePlan(
        None, batch=1, q_len=100, k_len=300, causal=False, block_k=16, max_merge_cols=64
    )
    segs = plan.segments(0, 0, 0)
    assert [s.k1 - s.k0 for s in segs] == [64, 64, 64, 64, 44]
    assert all(not s.partial for s in segs)


def test_head_units() -> None:
    assert [(u.q0, u.q1, u.kv0, u.n_kv, u.group) for u in head_units(8, 2, 1)] == [(0, 8, 0, 2, 4)]
    assert [(u.kv0, u.n_kv, u.group) for u in head_units(8, 2, 2)] == [(0, 1, 4), (1, 1, 4)]
    assert [(u.q0, u.kv0, u.group) for u in head_units(4, 2, 4)] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 1, 1),
        (3, 1, 1),
    ]
    with pytest.raises(ValueError, match="divide"):
        head_units(6, 4, 1)


def test_heads_first_augmented_layout_and_rank_one_product() -> None:
    """`[B, S, H, X]` -> `[B, H, S, X + 1]` with the given last column, the input untouched;
    a matmul against a column of ones then adds that column to every row of the product."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3, 4))
    keep = x.copy()
    col = rng.standard_normal((2, 3, 5))
    xa = heads_first_augmented(x, col)
    assert xa.shape == (2, 3, 5, 5) and xa.flags.c_contiguous
    np.testing.assert_array_equal(xa[..., :4], x.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(xa[..., 4], col)
    np.testing.assert_array_equal(x, keep)
    ones = heads_first_augmented(x, 1)
    np.testing.assert_array_equal(ones[..., 4], 1)
    want = xa[..., :4] @ ones[..., :4].swapaxes(-1, -2) + col[..., None]
    np.testing.assert_allclose(xa @ ones.swapaxes(-1, -2), want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ front door


def _tensors(B=1, Sq=8, Sk=8, Hq=2, Hkv=2, D=4, dtype="float32"):
    rng = np.random.default_rng(0)
    q, k, v, _ = make_inputs(rng, B, Sq, Sk, Hq, Hkv, D)
    return tuple(paddle.to_tensor(x).astype(dtype) for x in (q, k, v))


def test_return_values_and_stop_gradient() -> None:
    q, k, v = _tensors()
    q.stop_gradient = False
    out = flashmask_attention(q, k, v, causal=True)
    assert isinstance(out, paddle.Tensor) and out.shape == [1, 8, 2, 4]
    out.sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None
    with paddle.no_grad():
        out, lse = flashmask_attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == [1, 2, 8] and lse.dtype == paddle.float32 and lse.stop_gradient


def test_with_version_matches_front_door() -> None:
    q, k, v = _tensors(Hq=4, Hkv=2)
    a = flashmask_attention(q, k, v, causal=True)
    for version in (2, 3, 4):
        b = flashmask_attention_with_version(q, k, v, causal=True, fa_version=version)
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="fa_version=5"):
        flashmask_attention_with_version(q, k, v, fa_version=5)


def _mask(values, shape, dtype="int32"):
    return paddle.to_tensor(np.broadcast_to(np.asarray(values), shape).copy(), dtype=dtype)


# name -> (rewrite (q, k, v, mask, kwargs) into a bad call, exception, message fragment)
BAD_INPUTS = {
    "dropout": (
        lambda q, k, v, m, kw: (q, k, v, m, {**kw, "dropout": 0.1}),
        NotImplementedError,
        "dropout",
    ),
    "rank3": (
        lambda q, k, v, m, kw: (q.reshape([2, 8, 16]), k, v, m, kw),
        ValueError,
        "q must be rank 4",
    ),
    "batch": (lambda q, k, v, m, kw: (q, k[:1], v, m, kw), ValueError, "batch sizes differ"),
    "kv_len": (
        lambda q, k, v, m, kw: (q, k, v[:, :4], m, kw),
        ValueError,
        "k and v lengths differ",
    ),
    "gqa": (
        lambda q, k, v, m, kw: (
            q,
            paddle.concat([k, k[:, :, :1]], 2),
            paddle.concat([v, v[:, :, :1]], 2),
            m,
            kw,
        ),
        ValueError,
        "multiple of the KV heads",
    ),
    "head_dim": (lambda q, k, v, m, kw: (q, k[..., :2], v, m, kw), ValueError, "head_dim differ"),
    "fp16_on_cpu": (
        lambda q, k, v, m, kw: (q.astype("float16"), k, v, m, kw),
        TypeError,
        "float32",
    ),
    "numpy_q": (
        lambda q, k, v, m, kw: (q.numpy(), k, v, m, kw),
        TypeError,
        "q must be a paddle.Tensor",
    ),
    "scale": (
        lambda q, k, v, m, kw: (q, k, v, m, {**kw, "softmax_scale": -1.0}),
        ValueError,
        "softmax_scale",
    ),
    "mask_int64": (
        lambda q, k, v, m, kw: (q, k, v, _mask(8, (2, 1, 8, 1), "int64"), kw),
        ValueError,
        "int32",
    ),
    "mask_cols": (
        lambda q, k, v, m, kw: (q, k, v, _mask(8, (2, 1, 8, 4)), kw),
        ValueError,
        "causal=True",
    ),
    "mask_sk": (
        lambda q, k, v, m, kw: (q, k, v, _mask(8, (2, 1, 7, 1)), kw),
        ValueError,
        "key length",
    ),
    "mask_heads": (
        lambda q, k, v, m, kw: (q, k, v, _mask(8, (2, 3, 8, 1)), kw),
        ValueError,
        "mask heads",
    ),
    "mask_values": (
        lambda q, k, v, m, kw: (q, k, v, _mask(-1, (2, 1, 8, 1)), kw),
        ValueError,
        r"value -1 is negative \(first at \[b, h, j, c\] = \[0, 0, 0, 0\]",
    ),
    "dropout_negative": (
        lambda q, k, v, m, kw: (q, k, v, m, {**kw, "dropout": -0.1}),
        ValueError,
        "dropout",
    ),
    "dropout_type": (
        lambda q, k, v, m, kw: (q, k, v, m, {**kw, "dropout": "0"}),
        TypeError,
        "dropout",
    ),
    "causal_type": (lambda q, k, v, m, kw: (q, k, v, m, {**kw, "causal": 1}), TypeError, "causal"),
    "empty": (lambda q, k, v, m, kw: (q[:, :0], k, v, m, kw), ValueError, "empty axis"),
    "kv_heads": (
        lambda q, k, v, m, kw: (q, k, v[:, :, :1], m, kw),
        ValueError,
        "head counts differ",
    ),
    "mask_numpy": (
        lambda q, k, v, m, kw: (q, k, v, m.numpy(), kw),
        TypeError,
        "startend_row_indices must be a paddle.Tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_input_validation(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input raises a clear error before any kernel runs (or any version is resolved)."""

    def boom(*a, **kw):
        raise AssertionError("compute or dispatch ran before validation")

    monkeypatch.setattr(registry, "get_backend", boom)
    monkeypatch.setattr(fa_dispatch, "resolve_current", boom)
    rewrite, error, match = BAD_INPUTS[case]
    q, k, v = _tensors(B=2, Sq=8, Sk=8, Hq=4, Hkv=2)
    q, k, v, mask, kwargs = rewrite(q, k, v, _mask(8, (2, 1, 8, 1)), {"causal": True})
    with pytest.raises(error, match=match):
        flashmask_attention(q, k, v, mask, **kwargs)


def test_fa4_requested_on_cpu_fails_like_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The version is resolved on every device: FLAGS=4 without FA4 raises under "error"."""
    q, k, v = _tensors()
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")
    with pytest.raises(fa_dispatch.FlashAttnUnavailableError, match="FA4"):
        flashmask_attention(q, k, v, causal=True)
    out = flashmask_attention(q, k, v, causal=True, fa4_unavailable="fallback")
    assert out.shape == [1, 8, 2, 4]
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "7")
    with pytest.raises(ValueError, match="FLAGS_flash_attn_version"):
        flashmask_attention(q, k, v, causal=True)


def test_attention_module_exports() -> None:
    assert callable(local.validate_attention_inputs)
    assert issubclass(interface.AttentionFn, paddle.autograd.PyLayer)


def test_backend_never_modifies_its_inputs() -> None:
    """Regression: with Sq = 1 the head-first transpose is already contiguous; q must not be
    scaled in place."""
    rng = np.random.default_rng(12)
    q, k, v, dout = make_inputs(rng, 1, 1, 5, 2, 2, 8)
    copies = [x.copy() for x in (q, k, v, dout)]
    backend = CpuReferenceBackend()
    out, lse = backend.forward(q, k, v, None, causal=False, softmax_scale=None)
    backend.backward(q, k, v, out, lse, None, dout, causal=False, softmax_scale=None)
    for x, c in zip((q, k, v, dout), copies, strict=True):
        np.testing.assert_array_equal(x, c)


def test_backend_and_plan_errors() -> None:
    backend = CpuReferenceBackend()
    assert "block_q=128" in repr(backend)
    x = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="paddle.Tensor or numpy"):
        backend.forward([1], x, x, None, causal=False, softmax_scale=None)
    with pytest.raises(TypeError, match="float32 or float64"):
        backend.forward(x, x.astype(np.float64), x, None, causal=False, softmax_scale=None)
    with pytest.raises(TypeError, match="float32 or float64"):
        backend.forward(*(x.astype(np.float16),) * 3, None, causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match="positive"):
        TilePlan(None, batch=1, q_len=4, k_len=4, causal=False, block_q=0)
    idx = np.full((2, 1, 4, 1), 4, np.int32)
    with pytest.raises(ValueError, match="batch 2"):
        TilePlan(idx, batch=3, q_len=4, k_len=4, causal=True)
    with pytest.raises(ValueError, match="not valid with causal=False"):
        TilePlan(idx, batch=2, q_len=4, k_len=4, causal=False)
    with pytest.raises(ValueError, match="align"):
        head_units(12, 4, 3)  # 4 query heads per mask head straddle KV groups of 3


# ------------------------------------------------------ values >= Sq ("through the last row")


def assert_bitwise(got, want) -> None:
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert np.array_equal(a, b), f"{name} differs"


@pytest.mark.parametrize("blocks", [(8, 8, 16), (16, 8, 1024)], indirect=True)
@pytest.mark.parametrize("sq", [45, 29])
@pytest.mark.parametrize("family", sorted(mask_families.FAMILIES))
def test_values_beyond_sq_equal_the_clipped_mask(family: str, sq: int, blocks) -> None:
    """Upstream reads any value >= Sq as Sq: same output, LSE and grads, bit for bit.

    The mask is built for Sk = 45 keys; with Sq = 29 its own "to the end" values (45) already
    exceed Sq, and every value >= Sq is then replaced by a random one up to 2**31 - 1. Same
    process, same tiles, same order, so the comparison with the clipped mask is bitwise; the
    dense float64 oracle checks that both are right.
    """
    sk = 45
    rng = np.random.default_rng(sq * 1000 + sorted(mask_families.FAMILIES).index(family))
    mask = mask_families.FAMILIES[family](2, sk, 1, 3)
    over = overshoot(mask.indices, sq, seed=sq)
    clipped = mask_indices.clip_rows(over, sq)
    assert (over > sq).any() and not np.array_equal(over, clipped)
    q, k, v, dout = make_inputs(rng, 2, sq, sk, 2, 1, 8)
    got = run_front_door(q, k, v, dout, over, causal=mask.causal)
    assert_bitwise(got, run_front_door(q, k, v, dout, clipped, causal=mask.causal))
    assert_matches(got, dense_reference(q, k, v, dout, over, causal=mask.causal))


def test_upstream_causal_idiom_sq_192_sk_256() -> None:
    """The reported case: causal, Sq=192, Sk=256, indices filled with Sk. It used to be refused
    ("value 256 is outside [0, Sq=192]"); now it is plain bottom-right causal attention."""
    sq, sk = 192, 256
    rng = np.random.default_rng(192)
    q, k, v, dout = make_inputs(rng, 1, sq, sk, 2, 1, 16)
    fill = {n: np.full((1, 1, sk, 1), n, np.int32) for n in (sk, sq, sq - 1)}
    got = run_front_door(q, k, v, dout, fill[sk], causal=True)
    assert_bitwise(got, run_front_door(q, k, v, dout, fill[sq], causal=True))
    assert_bitwise(got, run_front_door(q, k, v, dout, None, causal=True))
    assert_matches(got, dense_reference(q, k, v, dout, None, causal=True))
    # Negative control: a real change of the mask (last row masked) does change the result.
    other = run_front_door(q, k, v, dout, fill[sq - 1], causal=True)
    assert not np.array_equal(got[0], other[0])
    plans = [
        TilePlan(fill[n], batch=1, q_len=sq, k_len=sk, causal=True, block_q=32, block_k=32)
        for n in (sk, sq)
    ]
    np.testing.assert_array_equal(plans[0].tiles, plans[1].tiles)
    assert plans[0].stats() == plans[1].stats()
