"""FlashMask mask library: builders vs independent dense definitions, the Paddle docs examples,
to_noncausal, classify_tiles, validate and the FAMILIES registry.

Expected dense masks are built here straight from each family's definition (who may see whom),
never through `to_dense`'s interval logic, so a wrong oracle or a wrong builder fails.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from flashcp import mask_indices, masks
from flashcp.mask_families import FAMILIES
from flashcp.mask_indices import (
    TILE_FULL,
    TILE_MASKED,
    TILE_PARTIAL,
    classify_tiles,
    to_dense,
    to_noncausal,
    validate,
)
from flashcp.masks import (
    Mask,
    causal_blockwise_mask,
    causal_document_mask,
    causal_mask,
    document_mask,
    global_sliding_window_mask,
    prefix_lm_causal_mask,
    prefix_lm_document_mask,
    qk_sparse_mask,
    random_eviction_mask,
    share_question_mask,
    sliding_window_mask,
)
from helpers.maskcases import INT32_MAX, overshoot

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------
# Independent dense definitions: bool [S, S], True = row i (query) may see column j (key).
# ------------------------------------------------------------------------------------------


def _grid(s: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(s)[:, None], np.arange(s)[None, :]


def _segment_ids(lens: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(lens)), lens)


def see_causal(s: int) -> np.ndarray:
    i, j = _grid(s)
    return j <= i


def see_sliding(s: int, window: int) -> np.ndarray:
    i, j = _grid(s)
    return (j <= i) & (j > i - window)


def see_causal_docs(lens: list[int]) -> np.ndarray:
    doc = _segment_ids(lens)
    return (doc[:, None] == doc[None, :]) & see_causal(sum(lens))


def see_docs(lens: list[int]) -> np.ndarray:
    doc = _segment_ids(lens)
    return doc[:, None] == doc[None, :]


def see_windowed_docs(lens: list[int], window: int, g: int = 0) -> np.ndarray:
    """Same document, causal, and the key among the query's last `window` tokens or among the
    document's first `g`."""
    start = np.repeat(np.cumsum(lens) - lens, lens)
    i, j = _grid(sum(lens))
    return see_causal_docs(lens) & ((j > i - window) | (j < start[None, :] + g))


def see_share_question(examples: list[tuple[int, ...]], s: int) -> np.ndarray:
    """Same example, causal, and the key is in the prompt or in the query's own answer."""
    example = np.full(s, -1)  # padding: one group whose tokens all count as "prompt"
    part = np.zeros(s, dtype=int)
    pos = 0
    for e, ex in enumerate(examples):
        for p, n in enumerate(ex):
            example[pos : pos + n] = e
            part[pos : pos + n] = p
            pos += n
    same_example = example[:, None] == example[None, :]
    key_ok = (part[None, :] == 0) | (part[:, None] == part[None, :])
    return same_example & key_ok & see_causal(s)


def see_prefix_lm(s: int, prefix: int) -> np.ndarray:
    i, j = _grid(s)
    return (j <= i) | (j < prefix)


def see_prefix_lm_docs(lens: list[int], prefixes: list[int]) -> np.ndarray:
    start = np.repeat(np.cumsum(lens) - lens, lens)
    prefix_end = start + np.repeat(prefixes, lens)
    i, j = _grid(sum(lens))
    return see_docs(lens) & ((j <= i) | (j < prefix_end[None, :]))


def see_global_window(s: int, g: int, left: int, right: int) -> np.ndarray:
    i, j = _grid(s)
    return (i < g) | (j < g) | ((j >= i - left) & (j <= i + right))


def see_causal_blockwise(lens: list[int]) -> np.ndarray:
    block = _segment_ids(lens)
    last = block[:, None] == len(lens) - 1
    return see_causal(sum(lens)) & ((block[:, None] == block[None, :]) | last)


def see_qk_sparse(s: int, spans: list[tuple[int, int]]) -> np.ndarray:
    span = np.full(s, -1)
    for k, (start, n) in enumerate(spans):
        span[start : start + n] = k
    both_in_span = (span[:, None] == span[None, :]) & (span[:, None] >= 0)
    return see_causal(s) & ~both_in_span


def assert_mask(m: Mask, visible: np.ndarray, *, batch: int = 1, heads: int = 1) -> None:
    """`m` is int32 [batch, heads, S, C], validates, and masks exactly what `visible` hides."""
    assert m.indices.dtype == np.int32
    assert m.indices.shape[:3] == (batch, heads, visible.shape[-1])
    validate(m.indices, causal=m.causal)
    np.testing.assert_array_equal(m.dense(), np.broadcast_to(~visible, m.dense().shape))


# ------------------------------------------------------------------------------------------
# Builders vs the definitions
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [1, 7, 16])
def test_causal(s: int) -> None:
    m = causal_mask(2, s, heads=3)
    assert m.causal and m.indices.shape == (2, 3, s, 1)
    assert_mask(m, see_causal(s), batch=2, heads=3)


@pytest.mark.parametrize(("s", "window"), [(10, 1), (10, 3), (11, 11), (9, 20)])
def test_sliding_window(s: int, window: int) -> None:
    assert_mask(sliding_window_mask(2, s, window), see_sliding(s, window), batch=2)


def test_sliding_window_per_head() -> None:
    windows = [1, 4, 13]
    m = sliding_window_mask(2, 13, windows)
    assert m.indices.shape == (2, 3, 13, 1)
    for h, w in enumerate(windows):
        np.testing.assert_array_equal(
            m.dense()[:, h], np.broadcast_to(~see_sliding(13, w), (2, 13, 13))
        )


@pytest.mark.parametrize("lens", [[10], [4, 3, 3], [1, 1, 5, 2]])
def test_causal_document(lens: list[int]) -> None:
    assert_mask(causal_document_mask(lens, heads=2), see_causal_docs(lens), heads=2)


@pytest.mark.parametrize("lens", [[10], [4, 3, 3], [1, 1, 5, 2]])
def test_document(lens: list[int]) -> None:
    m = document_mask(lens, batch=3)
    assert not m.causal and m.indices.shape[-1] == 2
    assert_mask(m, see_docs(lens), batch=3)


def test_documents_per_batch_row() -> None:
    rows = [[4, 3, 3], [2, 8], [10]]
    for build, see in ((causal_document_mask, see_causal_docs), (document_mask, see_docs)):
        m = build(rows)
        assert m.indices.shape[0] == 3
        for b, lens in enumerate(rows):
            np.testing.assert_array_equal(m.dense()[b, 0], ~see(lens))


@pytest.mark.parametrize(
    ("examples", "s"),
    [
        ([(4, 3, 3)], 10),  # the docs example
        ([(2, 1, 1), (3, 2, 4)], 13),  # two examples, no padding
        ([(2, 1, 1), (1, 2, 2, 2)], 15),  # three answers in the second example, 3 padding
        ([], 5),  # padding only
    ],
)
def test_share_question(examples: list[tuple[int, ...]], s: int) -> None:
    m = share_question_mask(examples, seq_len=s)
    assert m.causal
    visible = see_share_question(examples, s)
    assert_mask(m, visible)
    assert visible.any(-1).all()  # padding rows are not fully masked


def test_share_question_rejected_cannot_see_chosen() -> None:
    d = share_question_mask([(3, 2, 2)]).dense()[0, 0]
    assert d[5:7, 3:5].all()  # rejected rows x chosen columns: masked
    assert not d[5:7, 0:3].any()  # rejected rows see the prompt
    assert not d[3:5, 0:3].any()  # chosen rows see the prompt


def test_share_question_per_batch_row() -> None:
    rows = [[(4, 3, 3)], [(2, 1, 1), (1, 1, 1)]]  # second row: 7 tokens + 3 padding
    m = share_question_mask(rows, heads=2)
    assert m.indices.shape == (2, 2, 10, 1)
    for b, ex in enumerate(rows):
        np.testing.assert_array_equal(m.dense()[b, 1], ~see_share_question(ex, 10))


@pytest.mark.parametrize("prefix", [0, 1, 5, 10])
def test_prefix_lm_causal(prefix: int) -> None:
    m = prefix_lm_causal_mask(2, 10, prefix)
    assert not m.causal
    assert_mask(m, see_prefix_lm(10, prefix), batch=2)


def test_prefix_lm_causal_per_batch_row() -> None:
    d = prefix_lm_causal_mask(2, 9, [2, 7]).dense()
    np.testing.assert_array_equal(d[0, 0], ~see_prefix_lm(9, 2))
    np.testing.assert_array_equal(d[1, 0], ~see_prefix_lm(9, 7))


@pytest.mark.parametrize(
    ("lens", "prefixes"), [([3, 2, 5], [2, 2, 2]), ([4, 5], [0, 5]), ([9], [3])]
)
def test_prefix_lm_document(lens: list[int], prefixes: list[int]) -> None:
    assert_mask(prefix_lm_document_mask(lens, prefixes), see_prefix_lm_docs(lens, prefixes))


@pytest.mark.parametrize(
    ("lens", "window", "g"),
    [([3, 2, 5], 2, 0), ([9, 7], 3, 2), ([4], 1, 0), ([6, 1, 5], 9, 1), ([12], 4, 12)],
)
def test_sliding_window_document(lens: list[int], window: int, g: int) -> None:
    m = masks.sliding_window_document_mask(lens, window, global_tokens=g, batch=2)
    assert m.causal and m.indices.shape[-1] == 1
    assert_mask(m, see_windowed_docs(lens, window, g), batch=2)


@FAST
@given(st.data())
def test_document_masking_builds_each_kind(data: st.DataObject) -> None:
    """`DocumentMasking.build`, the mask `attention.mask` gives each packed document, is the
    definition of its kind on every row (own lengths, prefixes, window, global tokens)."""
    kind = data.draw(st.sampled_from(masks.DOCUMENT_MASKS))
    rows = data.draw(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1,
                              max_size=3))  # fmt: skip
    s = max(sum(r) for r in rows)
    rows = [[*r, s - sum(r)] if sum(r) < s else r for r in rows]  # pad every row to s
    prefixes = [[data.draw(st.integers(0, n)) for n in r] for r in rows]
    window, g = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 5))
    spec = masks.DocumentMasking(
        kind, window if "window" in kind else None, g if kind == "global_window" else 0
    )
    m = spec.build(rows, prefixes)
    for b, (lens, pre) in enumerate(zip(rows, prefixes, strict=True)):
        if kind == "causal":
            want = see_causal_docs(lens)
        elif kind == "prefix_lm":
            want = see_prefix_lm_docs(lens, pre)
        else:
            want = see_windowed_docs(lens, window, g if kind == "global_window" else 0)
        np.testing.assert_array_equal(m.dense()[b, 0], ~want)
    validate(m.indices, causal=m.causal)


def test_document_masking_causal_is_the_causal_document_mask() -> None:
    """The default keeps the exact mask (bytes, causal flag) runs trained on before it."""
    rows = [[3, 5, 2], [10]]
    got, want = masks.DocumentMasking().build(rows), causal_document_mask(rows, batch=2)
    assert got.causal == want.causal and got.indices.tobytes() == want.indices.tobytes()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "banana"}, "expected one of"),
        ({"kind": "sliding_window"}, "needs a window >= 1"),
        ({"kind": "global_window", "window": 4}, "needs global_tokens >= 1"),
    ],
)
def test_document_masking_refuses_incomplete_specs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        masks.DocumentMasking(**kwargs)
    with pytest.raises(ValueError, match="prefix length"):
        masks.DocumentMasking("prefix_lm").build([[4]])


@pytest.mark.parametrize(
    ("s", "g", "window"), [(10, 2, 1), (16, 3, (2, 4)), (9, 0, (0, 0)), (8, 8, 2), (13, 1, 20)]
)
def test_global_sliding_window(s: int, g: int, window: int | tuple[int, int]) -> None:
    left, right = (window, window) if isinstance(window, int) else window
    m = global_sliding_window_mask(s, g, window, batch=2)
    assert not m.causal and m.indices.shape[-1] == 4
    assert_mask(m, see_global_window(s, g, left, right), batch=2)


@pytest.mark.parametrize("lens", [[4, 3, 3], [2, 2, 2, 5], [7], [1, 6]])
def test_causal_blockwise(lens: list[int]) -> None:
    m = causal_blockwise_mask(lens)
    assert m.causal and m.indices.shape[-1] == 2
    assert_mask(m, see_causal_blockwise(lens))


@pytest.mark.parametrize(
    ("s", "spans"), [(10, [(2, 3), (6, 2)]), (12, [(1, 11)]), (6, []), (9, [(3, 1), (4, 1)])]
)
def test_qk_sparse(s: int, spans: list[tuple[int, int]]) -> None:
    assert_mask(qk_sparse_mask(s, spans, heads=2), see_qk_sparse(s, spans), heads=2)


def test_random_eviction() -> None:
    m = random_eviction_mask(3, 17, heads=4, seed=5)
    lts = m.indices[..., 0]
    assert m.causal and m.indices.shape == (3, 4, 17, 1)
    j = np.arange(17)
    assert ((lts > j) & (lts <= 17)).all()  # the diagonal stays visible
    i = j[:, None]
    for b in range(3):
        for h in range(4):
            visible = (j[None, :] <= i) & (i < lts[b, h][None, :])  # column j lives in [j, LTS)
            np.testing.assert_array_equal(m.dense()[b, h], ~visible)
    np.testing.assert_array_equal(random_eviction_mask(3, 17, 4, seed=5).indices, m.indices)
    assert not np.array_equal(random_eviction_mask(3, 17, 4, seed=6).indices, m.indices)
    assert len({lts[0, h].tobytes() for h in range(4)}) > 1  # heads draw separately


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: causal_document_mask([[4, 6], [5, 4]]), "sums to 9"),
        (lambda: causal_document_mask([4, 0, 6]), "lengths >= 1"),
        (lambda: causal_document_mask([[4, 6]], batch=2), "1 batch rows but batch=2"),
        (lambda: sliding_window_mask(1, 8, 0), "windows must be >= 1"),
        (lambda: sliding_window_mask(1, 8, [1, 2], heads=3), "2 per-head windows"),
        (lambda: masks.sliding_window_document_mask([4], 0), "window must be >= 1"),
        (lambda: share_question_mask([(4, 3, 3)], seq_len=9), "need 10 tokens"),
        (lambda: share_question_mask([(4,)]), "at least one answer"),
        (lambda: prefix_lm_causal_mask(1, 8, 9), r"in \[0, 8\]"),
        (lambda: prefix_lm_document_mask([3, 4], [4, 0]), "one prefix in"),
        (lambda: qk_sparse_mask(10, [(2, 4), (5, 1)]), "non-overlapping"),
        (lambda: qk_sparse_mask(10, [(8, 3)]), "non-overlapping"),
        (lambda: global_sliding_window_mask(10, 2, -1), ">= 0"),
        (lambda: causal_mask(1, 8, heads=0), "heads must be >= 1"),
    ],
)
def test_builder_errors(build: Callable[[], Mask], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


# ------------------------------------------------------------------------------------------
# The S = 10 examples from Paddle's flashmask_attention docstring: indices and pictures
# (1 = attended), written out as documented.
# ------------------------------------------------------------------------------------------


def _picture(*rows: str) -> np.ndarray:
    return np.array([[c == "1" for c in r] for r in rows])


def _col(*cols: list[int]) -> np.ndarray:
    return np.stack(cols, axis=-1).astype(np.int32).reshape(1, 1, 10, len(cols))


DOCS = {
    "causal_padded": (  # "Causal Mask" in the docstring: rows 8, 9 are fully masked
        True,
        _col([8] * 10),
        _picture(
            "1000000000", "1100000000", "1110000000", "1111000000", "1111100000",
            "1111110000", "1111111000", "1111111100", "0000000000", "0000000000",
        ),
        None,
    ),
    "sliding_window": (
        True,
        _col([3, 4, 5, 6, 7, 8, 9, 10, 10, 10]),
        _picture(
            "1000000000", "1100000000", "1110000000", "0111000000", "0011100000",
            "0001110000", "0000111000", "0000011100", "0000001110", "0000000111",
        ),
        lambda: sliding_window_mask(1, 10, 3),
    ),
    "causal_document": (
        True,
        _col([4, 4, 4, 4, 7, 7, 7, 10, 10, 10]),
        _picture(
            "1000000000", "1100000000", "1110000000", "1111000000", "0000100000",
            "0000110000", "0000111000", "0000000100", "0000000110", "0000000111",
        ),
        lambda: causal_document_mask([4, 3, 3]),
    ),
    "document": (
        False,
        _col([4, 4, 4, 4, 7, 7, 7, 10, 10, 10], [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]),
        _picture(
            "1111000000", "1111000000", "1111000000", "1111000000", "0000111000",
            "0000111000", "0000111000", "0000000111", "0000000111", "0000000111",
        ),
        lambda: document_mask([4, 3, 3]),
    ),
    "share_question": (
        True,
        _col([10, 10, 10, 10, 7, 7, 7, 10, 10, 10]),
        _picture(
            "1000000000", "1100000000", "1110000000", "1111000000", "1111100000",
            "1111110000", "1111111000", "1111000100", "1111000110", "1111000111",
        ),
        lambda: share_question_mask([(4, 3, 3)]),
    ),
    "global_sliding_window": (
        False,
        _col(
            [10, 10, 4, 5, 6, 7, 8, 9, 10, 10],
            [10] * 10,
            [0, 0, 0, 0, 2, 2, 2, 2, 2, 2],
            [0, 0, 0, 0, 3, 4, 5, 6, 7, 8],
        ),
        _picture(
            "1111111111", "1111111111", "1111000000", "1111100000", "1101110000",
            "1100111000", "1100011100", "1100001110", "1100000111", "1100000011",
        ),
        lambda: global_sliding_window_mask(10, 2, 1),
    ),
    "causal_blockwise": (
        True,
        _col([4, 4, 4, 4, 10, 10, 10, 10, 10, 10], [7, 7, 7, 7, 10, 10, 10, 10, 10, 10]),
        _picture(
            "1000000000", "1100000000", "1110000000", "1111000000", "0000100000",
            "0000110000", "0000111000", "1111111100", "1111111110", "1111111111",
        ),
        lambda: causal_blockwise_mask([4, 3, 3]),
    ),
    "prefix_lm_document": (
        False,
        _col([3, 3, 3, 5, 5, 10, 10, 10, 10, 10], [0, 0, 2, 3, 3, 5, 5, 7, 8, 9]),
        _picture(
            "1100000000", "1100000000", "1110000000", "0001100000", "0001100000",
            "0000011000", "0000011000", "0000011100", "0000011110", "0000011111",
        ),
        lambda: prefix_lm_document_mask([3, 2, 5], [2, 2, 2]),
    ),
    "prefix_lm_causal": (
        False,
        _col([10] * 10, [0, 0, 0, 0, 0, 5, 6, 7, 8, 9]),
        _picture(
            "1111100000", "1111100000", "1111100000", "1111100000", "1111100000",
            "1111110000", "1111111000", "1111111100", "1111111110", "1111111111",
        ),
        lambda: prefix_lm_causal_mask(1, 10, 5),
    ),
    "qk_sparse": (  # docs write the empty range of column 5 as [5, 5]; ours is [10, 10]
        True,
        _col([10, 10, 2, 3, 4, 5, 6, 7, 10, 10], [10, 10, 5, 5, 5, 5, 8, 8, 10, 10]),
        _picture(
            "1000000000", "1100000000", "1100000000", "1100000000", "1100000000",
            "1111110000", "1111110000", "1111110000", "1111111110", "1111111111",
        ),
        lambda: qk_sparse_mask(10, [(2, 3), (6, 2)]),
    ),
    "random_eviction": (  # figure (h); the picture is derived by hand from the indices
        True,
        _col([10, 4, 8, 6, 10, 7, 10, 9, 10, 10]),
        _picture(
            "1000000000", "1100000000", "1110000000", "1111000000", "1011100000",
            "1011110000", "1010111000", "1010101100", "1000101110", "1000101011",
        ),
        None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(DOCS))
def test_docs_example(name: str) -> None:
    causal, indices, visible, build = DOCS[name]
    np.testing.assert_array_equal(to_dense(indices, causal=causal)[0, 0], ~visible)
    if build is None:
        return
    m = build()
    assert m.causal == causal
    np.testing.assert_array_equal(m.dense()[0, 0], ~visible)
    if name != "qk_sparse":
        np.testing.assert_array_equal(m.indices, indices)


# ------------------------------------------------------------------------------------------
# to_noncausal
# ------------------------------------------------------------------------------------------


@st.composite
def random_masks(draw: st.DrawFn, *, ordered: bool = False) -> tuple[np.ndarray, bool, int]:
    """Arbitrary (or, with `ordered`, validate-clean) masks with Sq possibly != Sk."""
    causal = draw(st.booleans())
    ncol = draw(st.sampled_from((1, 2) if causal else (2, 4)))
    b, hm = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sk, sq = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    idx = draw(arrays(np.int32, (b, hm, sk, ncol), elements=st.integers(0, sq)))
    if ordered and ncol > 1:
        pairs = [(0, 1)] if ncol == 2 and causal else [(0, 1), (2, 3)] if ncol == 4 else []
        for lo, hi in pairs:
            idx[..., lo], idx[..., hi] = (
                np.minimum(idx[..., lo], idx[..., hi]),
                np.maximum(idx[..., lo], idx[..., hi]),
            )
    return idx, causal, sq


@FAST
@given(random_masks())
def test_to_noncausal_preserves_dense(case: tuple[np.ndarray, bool, int]) -> None:
    idx, causal, sq = case
    out = to_noncausal(idx, causal=causal, q_len=sq)
    assert out.dtype == np.int32 and out.shape[:3] == idx.shape[:3]
    assert out.shape[-1] == ({1: 2, 2: 4}[idx.shape[-1]] if causal else idx.shape[-1])
    np.testing.assert_array_equal(
        to_dense(out, causal=False, q_len=sq), to_dense(idx, causal=causal, q_len=sq)
    )


def test_to_noncausal_square_columns() -> None:
    lts = causal_document_mask([4, 3, 3]).indices
    out = to_noncausal(lts, causal=True)
    np.testing.assert_array_equal(out[0, 0, :, 1], np.arange(10))  # UTE = j: rows < j masked
    two = causal_blockwise_mask([4, 3, 3]).indices
    out4 = to_noncausal(two, causal=True)
    np.testing.assert_array_equal(out4[..., :2], two)
    np.testing.assert_array_equal(out4[0, 0, :, 2], np.zeros(10))
    np.testing.assert_array_equal(out4[0, 0, :, 3], np.arange(10))


@pytest.mark.parametrize(("sk", "sq"), [(10, 4), (4, 10)])
def test_to_noncausal_bottom_right(sk: int, sq: int) -> None:
    idx = np.full((1, 1, sk, 1), sq, dtype=np.int32)
    ute = to_noncausal(idx, causal=True, q_len=sq)[0, 0, :, 1]
    np.testing.assert_array_equal(ute, np.clip(np.arange(sk) - (sk - sq), 0, sq))
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    expect = i < j - (sk - sq)  # bottom-right causal, written directly
    out = to_noncausal(idx, causal=True, q_len=sq)
    np.testing.assert_array_equal(to_dense(out, causal=False, q_len=sq)[0, 0], expect)


def test_to_noncausal_noncausal_is_a_copy() -> None:
    idx = document_mask([4, 6]).indices
    out = to_noncausal(idx, causal=False)
    np.testing.assert_array_equal(out, idx)
    out[...] = 0
    assert idx.any()


def test_old_upstream_conversion_is_detected() -> None:
    """Appending arange twice (UTS = UTE = j) gives an empty upper range: causality is lost."""
    idx = causal_blockwise_mask([4, 3, 3]).indices
    j = np.arange(10, dtype=np.int32).reshape(1, 1, 10, 1)
    wrong = np.concatenate([idx, j, j], axis=-1)
    expect = to_dense(idx, causal=True)
    assert not np.array_equal(to_dense(wrong, causal=False), expect)
    assert not to_dense(wrong, causal=False)[0, 0, 0, 1]  # row 0 would see the future key 1
    np.testing.assert_array_equal(to_dense(to_noncausal(idx, causal=True), causal=False), expect)


def test_to_noncausal_rejects_bad_columns() -> None:
    with pytest.raises(ValueError, match="3 columns"):
        to_noncausal(np.zeros((1, 1, 4, 3), np.int32), causal=True)


def test_mask_noncausal_method() -> None:
    m = share_question_mask([(3, 2, 2)])
    n = m.noncausal()
    assert not n.causal and n.indices.shape[-1] == 2
    np.testing.assert_array_equal(n.dense(), m.dense())


# ------------------------------------------------------------------------------------------
# classify_tiles
# ------------------------------------------------------------------------------------------


def _check_tiles(idx: np.ndarray, causal: bool, sq: int, bq: int, bk: int) -> np.ndarray:
    tiles = classify_tiles(idx, causal=causal, q_len=sq, block_q=bq, block_k=bk)
    dense = to_dense(idx, causal=causal, q_len=sq)
    b, hm, _, sk = dense.shape
    assert tiles.shape == (b, hm, -(-sq // bq), -(-sk // bk))
    for qb in range(tiles.shape[2]):
        for kb in range(tiles.shape[3]):
            cell = dense[:, :, qb * bq : (qb + 1) * bq, kb * bk : (kb + 1) * bk]
            t = tiles[:, :, qb, kb]
            assert cell.all(axis=(-1, -2))[t == TILE_MASKED].all()  # MASKED: nothing visible
            assert not cell.any(axis=(-1, -2))[t == TILE_FULL].any()  # FULL: nothing masked
    return tiles


@FAST
@given(random_masks(), st.integers(1, 8), st.integers(1, 8))
def test_classify_tiles_is_safe(case: tuple[np.ndarray, bool, int], bq: int, bk: int) -> None:
    idx, causal, sq = case
    _check_tiles(idx, causal, sq, bq, bk)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_classify_tiles_on_families(name: str) -> None:
    m = FAMILIES[name](2, 37, 2, 3)
    _check_tiles(m.indices, m.causal, 37, 8, 4)
    _check_tiles(m.indices, m.causal, 37, 5, 16)


def test_classify_tiles_causal_is_exact() -> None:
    tiles = classify_tiles(causal_mask(1, 16).indices, causal=True, block_q=4, block_k=4)[0, 0]
    q, k = np.arange(4)[:, None], np.arange(4)[None, :]
    expect = np.where(q > k, TILE_FULL, np.where(q < k, TILE_MASKED, TILE_PARTIAL))
    np.testing.assert_array_equal(tiles, expect)


def test_classify_tiles_documents_are_exact() -> None:
    tiles = classify_tiles(document_mask([8, 8]).indices, causal=False, block_q=4, block_k=4)
    same_doc = (np.arange(4)[:, None] // 2) == (np.arange(4)[None, :] // 2)
    np.testing.assert_array_equal(tiles[0, 0], np.where(same_doc, TILE_FULL, TILE_MASKED))


# ------------------------------------------------------------------------------------------
# validate
# ------------------------------------------------------------------------------------------


@FAST
@given(random_masks(ordered=True))
def test_validate_accepts_ordered_masks(case: tuple[np.ndarray, bool, int]) -> None:
    idx, causal, sq = case
    assert validate(idx, causal=causal, q_len=sq) is idx


@FAST
@given(
    st.sampled_from(sorted(FAMILIES)),
    st.integers(1, 3),
    st.integers(1, 70),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 2**31),
)
def test_validate_accepts_every_family(name: str, b: int, s: int, h: int, seed: int) -> None:
    m = FAMILIES[name](b, s, h, seed)
    validate(m.indices, causal=m.causal, batch=b, q_len=s, k_len=s, num_q_heads=h)
    noncausal = m.noncausal()
    validate(noncausal.indices, causal=False, batch=b, q_len=s, k_len=s, num_kv_heads=h)


def test_validate_accepts_paddle_tensor() -> None:
    import paddle  # a required dependency: a broken install must fail, not skip

    idx = causal_document_mask([4, 6]).indices
    out = validate(paddle.to_tensor(idx), causal=True, batch=1, k_len=10)
    np.testing.assert_array_equal(out, idx)
    with pytest.raises(ValueError, match="must be int32, got int64"):
        validate(paddle.to_tensor(idx.astype(np.int64)), causal=True)


def _idx(*shape: int, fill: int = 0) -> np.ndarray:
    return np.full(shape, fill, dtype=np.int32)


def _with(idx: np.ndarray, pos: tuple[int, ...], value: int) -> np.ndarray:
    idx = idx.copy()
    idx[pos] = value
    return idx


@pytest.mark.parametrize(
    ("idx", "kwargs", "match"),
    [
        (_idx(1, 10, 1), {"causal": True}, r"rank 4 .*got shape \(1, 10, 1\).*reshape"),
        (
            np.zeros((1, 1, 10, 1), np.int64),
            {"causal": True},
            r"must be int32, got int64; cast it",
        ),
        (_idx(1, 1, 10, 1), {"causal": True, "batch": 2}, r"batch 1 .*query batch is 2"),
        (_idx(2, 1, 10, 1), {"causal": True, "k_len": 12}, r"Sk=10 key columns .*key length is 12"),
        (
            _idx(1, 3, 10, 1),
            {"causal": True, "num_q_heads": 8, "num_kv_heads": 2},
            r"Hm=3 mask heads .*one of \[1, 2, 8\]",
        ),
        (_idx(1, 1, 10, 4), {"causal": True}, r"C=4 columns .*causal=True.*C in \(1, 2\)"),
        (_idx(1, 1, 10, 1), {"causal": False}, r"C=1 columns .*causal=False.*to_noncausal"),
        (_idx(1, 1, 10, 3), {"causal": False}, r"C=3 columns"),
        (
            _with(_idx(1, 1, 10, 1), (0, 0, 7, 0), -3),
            {"causal": True},
            r"value -3 is negative \(first at \[b, h, j, c\] = \[0, 0, 7, 0\], 1 bad entries",
        ),
        (
            _with(_idx(1, 1, 10, 2, fill=99), (0, 0, 2, 1), -1),
            {"causal": False},
            r"value -1 is negative .*\[0, 0, 2, 1\].*>= Sq=10 means through the last row",
        ),
        (
            _with(_idx(1, 1, 10, 2, fill=5), (0, 0, 3, 0), 300),
            {"causal": True, "q_len": 8},
            r"LTS > LTE \(300 > 5, first at \[b, h, j, c\] = \[0, 0, 3, 0\]",
        ),
        (
            _with(_idx(1, 1, 10, 2, fill=5), (0, 0, 3, 0), 7),
            {"causal": True},
            r"LTS > LTE \(7 > 5, first at \[b, h, j, c\] = \[0, 0, 3, 0\].*empty one as LTS = LTE",
        ),
        (
            _with(_idx(1, 1, 10, 4, fill=5), (0, 0, 9, 2), 6),
            {"causal": False},
            r"UTS > UTE \(6 > 5, .*\[0, 0, 9, 2\]",
        ),
    ],
)
def test_validate_errors(idx: np.ndarray, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(idx, **kwargs)


def test_validate_allows_overlapping_lower_and_upper_ranges() -> None:
    """A converted causal mask can have UTE > LTS; the kernel masks the union, so it is valid."""
    idx = np.array([[10, 10], [0, 1], [1, 2]], dtype=np.int32).reshape(1, 1, 3, 2)
    validate(idx, causal=False, q_len=10)


def test_validate_head_rules() -> None:
    idx = _idx(1, 2, 8, 1)
    validate(idx, causal=True, num_q_heads=8, num_kv_heads=2)
    validate(idx, causal=True)  # head counts unknown: not checked
    validate(_idx(1, 1, 8, 1), causal=True, num_q_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match="Hm=2"):
        validate(idx, causal=True, num_q_heads=4)


# ------------------------------------------------------------------------------------------
# FAMILIES
# ------------------------------------------------------------------------------------------

REQUIRED = {
    "causal",
    "sliding_window",
    "sliding_window_per_head",
    "causal_document",
    "document",
    "share_question",
    "prefix_lm_causal",
    "prefix_lm_document",
    "global_sliding_window",
    "causal_blockwise",
    "random_eviction",
    "qk_sparse",
}


def test_families_cover_every_family() -> None:
    assert set(FAMILIES) >= REQUIRED


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("s", [8, 9, 13, 16, 31, 64, 127])
def test_family(name: str, s: int) -> None:
    m = FAMILIES[name](2, s, 3, 11)
    assert isinstance(m, Mask) and m.indices.dtype == np.int32
    assert m.indices.shape[:3] == (2, 3, s)
    validate(m.indices, causal=m.causal, batch=2, q_len=s, k_len=s, num_q_heads=3)
    dense = m.dense()
    assert not dense.all(axis=-1).any(), "a query row is fully masked"
    np.testing.assert_array_equal(FAMILIES[name](2, s, 3, 11).indices, m.indices)
    np.testing.assert_array_equal(m.noncausal().dense(), dense)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_uses_seed(name: str) -> None:
    """Seeded families differ across seeds somewhere; fixed ones (causal) do not."""
    draws = {FAMILIES[name](3, 64, 2, seed).indices.tobytes() for seed in range(8)}
    assert (len(draws) == 1) == (name == "causal")


def test_per_head_family_differs_by_head() -> None:
    idx = FAMILIES["sliding_window_per_head"](1, 64, 4, 0).indices
    assert len({idx[0, h].tobytes() for h in range(4)}) > 1


def test_module_exports() -> None:
    """The record and the builders in `masks`, the index format's functions in `mask_indices`."""
    for name in ("Mask", "DocumentMasking", "causal_mask", "causal_document_mask"):
        assert hasattr(masks, name)
    for name in ("to_noncausal", "validate", "to_dense", "classify_tiles", "clip_rows"):
        assert hasattr(mask_indices, name)
    assert not hasattr(masks, "FAMILIES")  # the seeded generators are not production code


# ------------------------------------------------------------------------------------------
# Values >= Sq: upstream FlashMask reads any of them as "through the last row" (= Sq)
# ------------------------------------------------------------------------------------------

BIG = INT32_MAX


@st.composite
def overshooting_masks(draw: st.DrawFn) -> tuple[np.ndarray, bool, int]:
    """Arbitrary masks, Sq possibly != Sk, with values up to far beyond Sq (never negative)."""
    idx, causal, sq = draw(random_masks(ordered=True))
    extra = draw(arrays(np.int32, idx.shape, elements=st.integers(0, 3 * sq + 5)))
    big = draw(arrays(np.bool_, idx.shape))
    over = np.where(idx == sq, np.where(big, BIG, sq + extra), idx).astype(np.int32)
    return over, causal, sq


def test_clip_rows_is_an_int32_copy() -> None:
    idx = np.array([0, 3, 8, 9, BIG], dtype=np.int32).reshape(1, 1, 5, 1)
    out = mask_indices.clip_rows(idx, 8)
    assert out.dtype == np.int32 and out is not idx
    np.testing.assert_array_equal(out.ravel(), [0, 3, 8, 8, 8])
    np.testing.assert_array_equal(idx.ravel(), [0, 3, 8, 9, BIG])  # input untouched


@FAST
@given(overshooting_masks(), st.integers(1, 8), st.integers(1, 8))
def test_values_beyond_sq_mean_sq(case: tuple[np.ndarray, bool, int], bq: int, bk: int) -> None:
    """Dense mask, tile classes, to_noncausal and validate agree with the clipped mask."""
    over, causal, sq = case
    clipped = mask_indices.clip_rows(over, sq)
    assert clipped.max(initial=0) <= sq
    np.testing.assert_array_equal(
        to_dense(over, causal=causal, q_len=sq), to_dense(clipped, causal=causal, q_len=sq)
    )
    np.testing.assert_array_equal(
        classify_tiles(over, causal=causal, q_len=sq, block_q=bq, block_k=bk),
        classify_tiles(clipped, causal=causal, q_len=sq, block_q=bq, block_k=bk),
    )
    np.testing.assert_array_equal(
        to_dense(to_noncausal(over, causal=causal, q_len=sq), causal=False, q_len=sq),
        to_dense(clipped, causal=causal, q_len=sq),
    )
    assert validate(over, causal=causal, q_len=sq) is over
    validate(clipped, causal=causal, q_len=sq)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_accepts_values_beyond_sq(name: str) -> None:
    """Each family's "to the end" entries written as random values >= Sq: same mask."""
    s, b, h = 37, 2, 2
    m = FAMILIES[name](b, s, h, 5)
    over = overshoot(m.indices, s)
    assert (over > s).any(), f"{name}: no entry at Sq, the test would be vacuous"
    validate(over, causal=m.causal, batch=b, q_len=s, k_len=s, num_q_heads=h)
    np.testing.assert_array_equal(to_dense(over, causal=m.causal), m.dense())
    np.testing.assert_array_equal(mask_indices.clip_rows(over, s), m.indices)
    for bq, bk in ((8, 4), (5, 16)):
        _check_tiles(over, m.causal, s, bq, bk)
        np.testing.assert_array_equal(
            classify_tiles(over, causal=m.causal, block_q=bq, block_k=bk),
            classify_tiles(m.indices, causal=m.causal, block_q=bq, block_k=bk),
        )


def test_upstream_causal_idiom_for_fewer_queries_than_keys() -> None:
    """The issue's case: causal, Sq=192, Sk=256, indices filled with Sk (upstream's idiom)."""
    sq, sk = 192, 256
    over = _idx(1, 1, sk, 1, fill=sk)
    validate(over, causal=True, batch=1, q_len=sq, k_len=sk)
    dense = to_dense(over, causal=True, q_len=sq)
    np.testing.assert_array_equal(
        dense, to_dense(_idx(1, 1, sk, 1, fill=sq), causal=True, q_len=sq)
    )
    rows, cols = np.arange(sq)[:, None], np.arange(sk)[None, :]
    np.testing.assert_array_equal(dense[0, 0], cols > rows + (sk - sq))  # bottom-right causal


def test_ranges_are_ordered_after_reading_values_as_sq() -> None:
    """[LTS, LTE] = [300, 250] with Sq = 8 is the empty range [8, 8): valid. [300, 5] is not."""
    validate(_with(_idx(1, 1, 10, 2, fill=250), (0, 0, 3, 0), 300), causal=True, q_len=8)
    validate(_with(_idx(1, 1, 10, 4, fill=9), (0, 0, 1, 2), BIG), causal=False, q_len=8)
    with pytest.raises(ValueError, match=r"UTS > UTE \(2147483647 > 3, "):
        validate(_with(_idx(1, 1, 10, 4, fill=3), (0, 0, 1, 2), BIG), causal=False, q_len=8)


@pytest.mark.parametrize(
    ("idx", "match"),
    [
        (
            _with(_idx(1, 1, 10, 1, fill=BIG), (0, 0, 4, 0), -1),
            r"value -1 is negative .*\[0, 0, 4, 0\]",
        ),
        (_idx(1, 1, 10, 1, fill=11).astype(np.int64), r"must be int32, got int64; cast it"),
        (_idx(1, 1, 10, 1, fill=11).astype(np.float32), r"must be int32, got float32"),
        (_idx(1, 10, 1, fill=11), r"rank 4 .*got shape \(1, 10, 1\)"),
        (_idx(1, 1, 10, 3, fill=11), r"C=3 columns"),
    ],
)
def test_values_beyond_sq_do_not_hide_other_errors(idx: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(idx, causal=True, q_len=10)
