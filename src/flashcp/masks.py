"""FlashMask column-wise masks (`startend_row_indices`): oracle, tiles, checks and builders.

A mask is int32 `[B, Hm, Sk, C]`: one entry per key column j, whose values are query-row
thresholds. With Sq query rows, row i and column j are masked iff

===========  ====  ==========================  ===========================================
causal       C     columns                     masked iff
===========  ====  ==========================  ===========================================
True         1     [LTS]                       i >= LTS[j]            or  i < j - (Sk - Sq)
True         2     [LTS, LTE]                  LTS[j] <= i < LTE[j]   or  i < j - (Sk - Sq)
False        2     [LTS, UTE]                  i >= LTS[j]            or  i < UTE[j]
False        4     [LTS, LTE, UTS, UTE]        LTS[j] <= i < LTE[j]   or  UTS[j] <= i < UTE[j]
===========  ====  ==========================  ===========================================

(`causal` is aligned to the bottom-right corner when Sq != Sk, as in FlashAttention >= 2.1.)

Values are >= 0 and have no upper bound: any value >= Sq means "through the last row" (as a
range end) and "no row" (as a range start), exactly what Sq itself means (`clip_rows` writes
them as Sq). This follows upstream: Paddle's `flashmask_attention` docstring
(python/paddle/nn/functional/flash_attention.py, Paddle 3.3.1) defines each value as the row
from which "the startend_row_indices[..., 0]-th row downwards (inclusive)" is masked, bounded
by nothing but the rows that exist, and upstream code builds an all-visible causal mask for
fewer query rows than keys (a CP rank's local rows, Sq != Sk) with
`paddle.full([b, 1, Sk, 1], fill_value=Sk)`.

Also here: `to_noncausal` (move causality into the indices, as CP needs), `validate`, one
builder per mask family of the FlashMask docs (each returns a `Mask`), `DocumentMasking` (the
mask a run's config gives each packed document: `attention.mask`). The seeded generators of
every family, for tests and benchmarks, are `flashcp.mask_families`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Tile classes returned by `classify_tiles`.
TILE_MASKED = 0  # every (row, column) of the tile is masked: skip it
TILE_PARTIAL = 1  # some masked: apply the mask inside the tile
TILE_FULL = 2  # nothing masked: no mask math at all


def as_numpy(startend_row_indices: Any) -> np.ndarray:
    """A numpy view of a mask given as numpy array or paddle Tensor."""
    if isinstance(startend_row_indices, np.ndarray):
        return startend_row_indices
    if hasattr(startend_row_indices, "numpy"):
        return np.asarray(startend_row_indices.numpy())
    return np.asarray(startend_row_indices)


def clip_rows(startend_row_indices: Any, q_len: int) -> np.ndarray:
    """The same mask with every value >= `q_len` written as `q_len` (a new int32 array).

    The canonical form of a mask for Sq = `q_len` query rows: a row threshold at or past the
    last row means "through the last row" whatever its value (see the module docstring), so
    `to_dense`, the tile classes and the kernel's output are the same for the mask and its
    clipped form. Negative values are left as they are (`validate` refuses them).
    """
    idx = as_numpy(startend_row_indices)
    return np.minimum(idx, int(q_len)).astype(np.int32)


def _intervals(idx: np.ndarray, causal: bool, q_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The masked row intervals [start, end) of each column, one (start, end) pair per range."""
    ncol = idx.shape[-1]
    big = np.full(idx.shape[:-1], q_len, dtype=np.int64)
    zero = np.zeros(idx.shape[:-1], dtype=np.int64)
    cols = [idx[..., c].astype(np.int64) for c in range(ncol)]
    if causal and ncol == 1:
        return [(cols[0], big)]
    if causal and ncol == 2:
        return [(cols[0], cols[1])]
    if not causal and ncol == 2:
        return [(cols[0], big), (zero, cols[1])]
    if not causal and ncol == 4:
        return [(cols[0], cols[1]), (cols[2], cols[3])]
    raise ValueError(
        f"startend_row_indices has {ncol} columns, which is not valid with causal={causal}: "
        "causal masks take 1 or 2 columns, non-causal masks take 2 or 4."
    )


def to_dense(startend_row_indices: Any, *, causal: bool, q_len: int | None = None) -> np.ndarray:
    """The dense boolean mask `[B, Hm, Sq, Sk]`, True = masked. The test oracle.

    `q_len` defaults to Sk (square attention).
    """
    idx = as_numpy(startend_row_indices)
    if idx.ndim != 4:
        raise ValueError(f"startend_row_indices must be rank 4 [B, Hm, Sk, C], got {idx.shape}")
    sk = idx.shape[2]
    sq = sk if q_len is None else int(q_len)
    rows = np.arange(sq).reshape(1, 1, sq, 1)
    masked = np.zeros((idx.shape[0], idx.shape[1], sq, sk), dtype=bool)
    for start, end in _intervals(idx, causal, sq):
        s = start[:, :, None, :]
        e = end[:, :, None, :]
        masked |= (rows >= s) & (rows < e)
    if causal:
        cols = np.arange(sk).reshape(1, 1, 1, sk)
        masked |= rows < cols - (sk - sq)
    return masked


def mask_head_index(q_head: int, num_q_heads: int, mask_heads: int) -> int:
    """The mask head used by query head `q_head` (Hm is 1, H_kv or H_q)."""
    return q_head // (num_q_heads // mask_heads)


def classify_tiles(
    startend_row_indices: Any,
    *,
    causal: bool,
    q_len: int | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> np.ndarray:
    """Per (q-block, k-block) tile: TILE_MASKED, TILE_PARTIAL or TILE_FULL, `[B, Hm, nq, nk]`.

    Decided from per-block min/max of each mask column, as FlashMask does: a tile is fully
    masked when one masked range covers all its rows in every column, and unmasked when every
    range misses all its rows in every column; anything else is partial (exact mask applied).
    Never builds an Sq x Sk array.
    """
    idx = as_numpy(startend_row_indices)
    b, hm, sk, _ = idx.shape
    sq = sk if q_len is None else int(q_len)
    idx = clip_rows(idx, sq)  # values >= Sq mean Sq: keeps the per-block min/max exact
    nq = -(-sq // block_q)
    nk = -(-sk // block_k)
    pad = nk * block_k - sk
    q0 = (np.arange(nq) * block_q).reshape(1, 1, nq, 1)
    q1 = np.minimum(q0 + block_q, sq)  # exclusive
    full = np.zeros((b, hm, nq, nk), dtype=bool)
    miss_all = np.ones((b, hm, nq, nk), dtype=bool)
    for start, end in _intervals(idx, causal, sq):
        # Pad the last partial k-block with edge values so min/max ignore the padding.
        s = np.pad(start, ((0, 0), (0, 0), (0, pad)), mode="edge").reshape(b, hm, nk, block_k)
        e = np.pad(end, ((0, 0), (0, 0), (0, pad)), mode="edge").reshape(b, hm, nk, block_k)
        s_min, s_max = s.min(-1)[:, :, None, :], s.max(-1)[:, :, None, :]
        e_min, e_max = e.min(-1)[:, :, None, :], e.max(-1)[:, :, None, :]
        full |= (s_max <= q0) & (e_min >= q1)
        miss_all &= (s_min >= q1) | (e_max <= q0) | (s_min >= e_max)
    if causal:
        off = sk - sq
        k0 = (np.arange(nk) * block_k).reshape(1, 1, 1, nk)
        k_last = np.minimum(k0 + block_k, sk) - 1
        # Causal masks rows i < j - off: the whole tile when its last row is below every column.
        full |= (q1 - 1) < (k0 - off)
        miss_all &= (k_last - off) <= q0
    out = np.full((b, hm, nq, nk), TILE_PARTIAL, dtype=np.int8)
    out[miss_all] = TILE_FULL
    out[full] = TILE_MASKED
    return out


# --------------------------------------------------------------------------------------------
# Mask record, conversion and validation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Mask:
    """A FlashMask mask: int32 `[B, Hm, Sk, C]` indices plus the `causal` flag they go with.

    `eq=False` because numpy arrays have no single truth value; compare `.indices` instead.
    """

    indices: np.ndarray
    causal: bool

    def dense(self, q_len: int | None = None) -> np.ndarray:
        """The dense boolean mask `[B, Hm, Sq, Sk]`, True = masked (see `to_dense`)."""
        return to_dense(self.indices, causal=self.causal, q_len=q_len)

    def noncausal(self, q_len: int | None = None) -> Mask:
        """The same mask written for `causal=False` (see `to_noncausal`)."""
        return Mask(to_noncausal(self.indices, causal=self.causal, q_len=q_len), causal=False)


def to_noncausal(
    startend_row_indices: Any, *, causal: bool, q_len: int | None = None
) -> np.ndarray:
    """The same dense mask expressed for `causal=False`, as a new int32 array.

    CP runs the kernel non-causally, so causality must move into the indices. Causal masks
    rows i < j - (Sk - Sq) of column j: that is an upper range `[0, UTE)` with
    UTE[j] = clip(j - (Sk - Sq), 0, Sq). So [LTS] -> [LTS, UTE] and [LTS, LTE] ->
    [LTS, LTE, 0, UTE]. Non-causal input is copied unchanged. (Appending UTS = UTE = j, as an
    old upstream conversion did, gives an empty upper range and silently drops causality.)
    """
    idx = as_numpy(startend_row_indices)
    if idx.ndim != 4:
        raise ValueError(f"startend_row_indices must be rank 4 [B, Hm, Sk, C], got {idx.shape}")
    ncol = idx.shape[-1]
    if ncol not in ((1, 2) if causal else (2, 4)):
        raise ValueError(
            f"startend_row_indices has {ncol} columns, which is not valid with causal={causal}: "
            "causal masks take 1 or 2 columns, non-causal masks take 2 or 4."
        )
    out = idx.astype(np.int32, copy=True)
    if not causal:
        return out
    b, hm, sk, _ = idx.shape
    sq = sk if q_len is None else int(q_len)
    ute = np.clip(np.arange(sk) - (sk - sq), 0, sq).astype(np.int32)
    ute = np.broadcast_to(ute.reshape(1, 1, sk, 1), (b, hm, sk, 1))
    if ncol == 1:
        return np.concatenate([out, ute], axis=-1)
    return np.concatenate([out, np.zeros_like(ute), ute], axis=-1)


def _first_bad(bad: np.ndarray) -> str:
    """`[b, h, j, c]` of the first True entry of `bad`, and how many there are."""
    pos = tuple(int(p) for p in np.argwhere(bad)[0])
    return f"first at [b, h, j, c] = {list(pos)}, {int(bad.sum())} bad entries in all"


def validate(
    startend_row_indices: Any,
    *,
    causal: bool,
    batch: int | None = None,
    q_len: int | None = None,
    k_len: int | None = None,
    num_q_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> np.ndarray:
    """Check a mask against what FlashMask needs; return it as numpy. Raises `ValueError`.

    Checks: rank 4, int32, B, Sk, Hm in {1, H_kv, H_q}, column count for `causal`, values
    >= 0, and each range ordered (LTS <= LTE, UTS <= UTE) once values >= Sq (Sq = q_len, else
    Sk) are read as Sq. Values above Sq are valid: as upstream FlashMask reads them, any value
    >= Sq means "through the last row" (e.g. a causal mask for Sq != Sk filled with Sk). The
    lower and upper ranges may overlap (e.g. a converted causal mask): the kernel masks their
    union. Arguments left as None are not checked.
    """
    idx = as_numpy(startend_row_indices)
    if idx.ndim != 4:
        raise ValueError(
            f"startend_row_indices must be rank 4 [B, Hm, Sk, C], got shape {tuple(idx.shape)}; "
            "add the missing axes, e.g. indices.reshape(B, 1, Sk, C)."
        )
    if idx.dtype != np.int32:
        raise ValueError(
            f"startend_row_indices must be int32, got {idx.dtype}; "
            "cast it with .astype(np.int32) or paddle.cast(x, 'int32')."
        )
    b, hm, sk, ncol = idx.shape
    if batch is not None and b != batch:
        raise ValueError(
            f"startend_row_indices has batch {b} (shape {tuple(idx.shape)}) but the query "
            f"batch is {batch}; build one mask row per sequence."
        )
    if k_len is not None and sk != k_len:
        raise ValueError(
            f"startend_row_indices has Sk={sk} key columns (shape {tuple(idx.shape)}) but the "
            f"key length is {k_len}; it needs one entry per key position (axis 2)."
        )
    allowed = {1} | {h for h in (num_kv_heads, num_q_heads) if h is not None}
    if len(allowed) > 1 and hm not in allowed:
        raise ValueError(
            f"startend_row_indices has Hm={hm} mask heads (shape {tuple(idx.shape)}); it must "
            f"be one of {sorted(allowed)} (1 broadcasts, else num_kv_heads or num_q_heads)."
        )
    ok_cols = (1, 2) if causal else (2, 4)
    if ncol not in ok_cols:
        raise ValueError(
            f"startend_row_indices has C={ncol} columns (shape {tuple(idx.shape)}), which is not "
            f"valid with causal={causal}: it needs C in {ok_cols}. Causal masks are [LTS] or "
            "[LTS, LTE]; non-causal are [LTS, UTE] or [LTS, LTE, UTS, UTE] "
            "(to_noncausal converts)."
        )
    sq = sk if q_len is None else int(q_len)
    bad = idx < 0
    if bad.any():
        v = int(idx[tuple(np.argwhere(bad)[0])])
        raise ValueError(
            f"startend_row_indices value {v} is negative ({_first_bad(bad)}); values are "
            f"query-row thresholds >= 0 (0 is the first row; any value >= Sq={sq} means "
            "through the last row): write 0 for the first row."
        )
    clipped = clip_rows(idx, sq)
    pairs = [(0, 1, "LTS", "LTE")] if (causal and ncol == 2) else []
    if ncol == 4:
        pairs = [(0, 1, "LTS", "LTE"), (2, 3, "UTS", "UTE")]
    for lo, hi, lo_name, hi_name in pairs:
        bad = np.zeros(idx.shape, dtype=bool)
        bad[..., lo] = clipped[..., lo] > clipped[..., hi]
        if bad.any():
            b0, h0, j0, _ = (int(p) for p in np.argwhere(bad)[0])
            raise ValueError(
                f"startend_row_indices has {lo_name} > {hi_name} "
                f"({int(idx[b0, h0, j0, lo])} > {int(idx[b0, h0, j0, hi])}, {_first_bad(bad)}); "
                f"a masked range is [{lo_name}, {hi_name}), write an empty one as "
                f"{lo_name} = {hi_name}."
            )
    return idx


# --------------------------------------------------------------------------------------------
# Builders. Each returns a validated square (Sq = Sk = seq_len) Mask, numpy int32.
# --------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer))


def _per_batch(spec: Sequence[Any], batch: int | None, nested: bool, name: str) -> list[Any]:
    """One spec per batch row: a nested spec is per-row already, a flat one is repeated."""
    if not nested:
        return [spec] * (1 if batch is None else batch)
    if batch is not None and batch != len(spec):
        raise ValueError(f"{name} gives {len(spec)} batch rows but batch={batch}")
    return list(spec)


def _check_lens(lens: Sequence[int], name: str, total: int | None = None) -> list[int]:
    out = [int(n) for n in lens]
    if not out or any(n < 1 for n in out):
        raise ValueError(f"{name} must be a non-empty list of lengths >= 1, got {list(lens)}")
    if total is not None and sum(out) != total:
        raise ValueError(f"{name} {out} sums to {sum(out)}, but every row must sum to {total}")
    return out


def _mask(rows: Sequence[np.ndarray], heads: int, causal: bool) -> Mask:
    """Stack per-batch `[Sk, C]` (shared by all heads) or `[Hm, Sk, C]` arrays into a Mask."""
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    per = [r[None] if r.ndim == 2 else r for r in rows]
    idx = np.stack([np.repeat(r, heads // r.shape[0], axis=0) for r in per]).astype(np.int32)
    return Mask(validate(idx, causal=causal), causal)


def causal_mask(batch: int, seq_len: int, heads: int = 1) -> Mask:
    """Plain causal attention: `[LTS] = Sq` masks nothing beyond the causal triangle."""
    return _mask([np.full((seq_len, 1), seq_len)] * batch, heads, causal=True)


def sliding_window_mask(
    batch: int, seq_len: int, window: int | Sequence[int], heads: int | None = None
) -> Mask:
    """Causal sliding window: row i sees columns (i - window, i], so LTS[j] = min(j + window, S).

    `window` counts the keys a query sees, itself included (flash-attn `window_size=w` is
    window = w + 1). A list gives one window per head.
    """
    windows = [int(window)] if _is_int(window) else [int(w) for w in window]  # type: ignore[union-attr]
    if heads is not None and len(windows) > 1 and heads != len(windows):
        raise ValueError(f"{len(windows)} per-head windows given but heads={heads}")
    if any(w < 1 for w in windows):
        raise ValueError(f"sliding windows must be >= 1 (a query sees itself), got {windows}")
    j = np.arange(seq_len)
    cols = np.stack([np.minimum(j + w, seq_len)[:, None] for w in windows])
    return _mask([cols] * batch, heads or len(windows), causal=True)


def _doc_rows(doc_lens: Sequence[Any], batch: int | None) -> list[list[int]]:
    nested = not _is_int(doc_lens[0]) if len(doc_lens) else False
    per = _per_batch(doc_lens, batch, nested, "doc_lens")
    first = _check_lens(per[0], "doc_lens")
    return [_check_lens(p, "doc_lens", sum(first)) for p in per]


def causal_document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]], batch: int | None = None, heads: int = 1
) -> Mask:
    """Packed documents, causal within each: LTS[j] = end of j's document (1 column).

    `doc_lens` is one list for every batch row, or one list per row; each sums to seq_len.
    """
    rows = [np.repeat(np.cumsum(lens), lens)[:, None] for lens in _doc_rows(doc_lens, batch)]
    return _mask(rows, heads, causal=True)


def sliding_window_document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    window: int,
    *,
    global_tokens: int = 0,
    batch: int | None = None,
    heads: int = 1,
) -> Mask:
    """Packed documents, each causal within a sliding window: a token sees the last `window`
    tokens of its own document (itself included, as `sliding_window_mask`), and with
    `global_tokens` g also the document's first g tokens (global tokens, attention sinks).

    LTS[j] = min(j + window, doc end), or doc end for a global column (1 column, causal).
    """
    if int(window) < 1 or int(global_tokens) < 0:
        raise ValueError(
            f"window must be >= 1 (a query sees itself) and global_tokens >= 0, got "
            f"{window}, {global_tokens}"
        )
    rows = []
    for lens in _doc_rows(doc_lens, batch):
        end = np.repeat(np.cumsum(lens), lens)
        offset = np.arange(len(end)) - (end - np.repeat(lens, lens))  # position in its doc
        lts = np.minimum(np.arange(len(end)) + int(window), end)
        rows.append(np.where(offset < int(global_tokens), end, lts)[:, None])
    return _mask(rows, heads, causal=True)


def document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]], batch: int | None = None, heads: int = 1
) -> Mask:
    """Packed documents, bidirectional within each: [LTS, UTE] = [doc end, doc start]."""
    rows = []
    for lens in _doc_rows(doc_lens, batch):
        end = np.cumsum(lens)
        rows.append(np.stack([np.repeat(end, lens), np.repeat(end - lens, lens)], axis=-1))
    return _mask(rows, heads, causal=False)


def _share_question_row(examples: Sequence[Sequence[int]], seq_len: int) -> np.ndarray:
    lts = np.full(seq_len, seq_len)  # trailing padding: one more causal document
    pos = 0
    for ex in examples:
        parts = _check_lens(ex, "each example (prompt_len, answer_len, ...)")
        if len(parts) < 2:
            raise ValueError(f"an example needs a prompt and at least one answer, got {ex}")
        end = pos + sum(parts)
        if end > seq_len:
            raise ValueError(f"examples need {end} tokens but seq_len is {seq_len}")
        lts[pos : pos + parts[0]] = end  # the prompt is seen by every answer of its example
        pos += parts[0]
        for n in parts[1:]:
            lts[pos : pos + n] = pos + n  # an answer is seen only by itself
            pos += n
    return lts[:, None]


def share_question_mask(
    examples: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
    seq_len: int | None = None,
    batch: int | None = None,
    heads: int = 1,
) -> Mask:
    """DPO packing: examples `(prompt_len, chosen_len, rejected_len, ...)` back to back, causal.

    Each answer sees its prompt and itself, never another answer or another example. Tokens
    after the last example (up to `seq_len`, default the longest row) are padding, treated as
    one more causal document so no row is fully masked. Nest one list of examples per row.
    """
    nested = bool(examples) and bool(examples[0]) and not _is_int(examples[0][0])  # type: ignore[index]
    per = _per_batch(examples, batch, nested, "examples")
    need = max(sum(sum(ex) for ex in row) for row in per)
    total = need if seq_len is None else int(seq_len)
    return _mask([_share_question_row(row, total) for row in per], heads, causal=True)


def prefix_lm_causal_mask(
    batch: int, seq_len: int, prefix_len: int | Sequence[int], heads: int = 1
) -> Mask:
    """Bidirectional over the first `prefix_len` tokens, causal after: [LTS, UTE] = [S, 0 | j].

    `prefix_len` is one int or one per batch row.
    """
    prefixes = [int(prefix_len)] * batch if _is_int(prefix_len) else [int(p) for p in prefix_len]  # type: ignore[union-attr]
    if len(prefixes) != batch or any(not 0 <= p <= seq_len for p in prefixes):
        raise ValueError(f"prefix_len needs {batch} value(s) in [0, {seq_len}], got {prefix_len}")
    j = np.arange(seq_len)
    rows = [np.stack([np.full(seq_len, seq_len), np.where(j < p, 0, j)], -1) for p in prefixes]
    return _mask(rows, heads, causal=False)


def prefix_lm_document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    prefix_lens: Sequence[int] | Sequence[Sequence[int]],
    batch: int | None = None,
    heads: int = 1,
) -> Mask:
    """Packed prefix-LM documents: each is bidirectional over its prefix and causal after it.

    [LTS, UTE] = [doc end, doc start] in a prefix, [doc end, j] after it.
    """
    docs = _doc_rows(doc_lens, batch)
    nested = bool(prefix_lens) and not _is_int(prefix_lens[0])
    prefs = _per_batch(prefix_lens, len(docs), nested, "prefix_lens")
    rows = []
    for lens, pre in zip(docs, prefs, strict=True):
        pre = [int(p) for p in pre]
        if len(pre) != len(lens) or any(not 0 <= p <= n for p, n in zip(pre, lens, strict=True)):
            raise ValueError(f"prefix_lens {pre} must give one prefix in [0, len] per doc {lens}")
        end = np.cumsum(lens)
        start = np.repeat(end - lens, lens)
        j = np.arange(int(end[-1]))
        ute = np.where(j < start + np.repeat(pre, lens), start, j)
        rows.append(np.stack([np.repeat(end, lens), ute], axis=-1))
    return _mask(rows, heads, causal=False)


def global_sliding_window_mask(
    seq_len: int,
    global_tokens: int,
    window: int | tuple[int, int],
    batch: int = 1,
    heads: int = 1,
) -> Mask:
    """Global tokens plus a bidirectional sliding window (4 columns), as in the FlashMask docs.

    The first `global_tokens` tokens see and are seen by everything; any other row i sees
    columns [i - left, i + right], with `window` = (left, right) or w for (w, w).
    """
    left, right = (int(window), int(window)) if _is_int(window) else map(int, window)  # type: ignore[arg-type]
    if global_tokens < 0 or left < 0 or right < 0:
        raise ValueError(f"global_tokens and window must be >= 0, got {global_tokens}, {window}")
    s, g = seq_len, min(int(global_tokens), seq_len)
    j = np.arange(s)
    lts = np.where(j < g, s, np.minimum(j + left + 1, s))
    ute = j - right
    has_upper = (j >= g) & (ute > g)  # rows [g, j - right) are masked; global rows never are
    cols = [lts, np.full(s, s), np.where(has_upper, g, 0), np.where(has_upper, ute, 0)]
    return _mask([np.stack(cols, axis=-1)] * batch, heads, causal=False)


def causal_blockwise_mask(
    block_lens: Sequence[int] | Sequence[Sequence[int]], batch: int | None = None, heads: int = 1
) -> Mask:
    """Causal blocks that see only themselves, then a last block that sees everything before it.

    [LTS, LTE] = [block end, last block start] (empty ranges written [S, S]), as in the
    FlashMask docs' in-context-learning example.
    """
    rows = []
    for lens in _doc_rows(block_lens, batch):
        end = np.repeat(np.cumsum(lens), lens)
        s, last = len(end), len(end) - lens[-1]
        empty = end >= last
        rows.append(np.stack([np.where(empty, s, end), np.where(empty, s, last)], axis=-1))
    return _mask(rows, heads, causal=True)


def random_eviction_mask(batch: int, seq_len: int, heads: int = 1, seed: int = 0) -> Mask:
    """KV-cache eviction: column j is evicted from a random row LTS[j] in [j + 1, S] onward.

    S means never evicted; LTS > j keeps the diagonal so no row is fully masked. Every
    (batch, head) draws its own rows from `seed`.
    """
    low = np.arange(seq_len) + 1
    lts = np.random.default_rng(seed).integers(low, seq_len + 1, size=(batch, heads, seq_len))
    return _mask(list(lts[..., None]), heads, causal=True)


def qk_sparse_mask(
    seq_len: int, spans: Sequence[tuple[int, int]], batch: int = 1, heads: int = 1
) -> Mask:
    """QK-sparse: inside each span (start, length) queries do not see the span's keys.

    A row in a span sees the tokens before the span only; later rows see everything (causal).
    [LTS, LTE] = [j, span end] for a span column, [S, S] elsewhere. A span at 0 leaves its
    first row fully masked.
    """
    lts = np.full(seq_len, seq_len)
    lte = np.full(seq_len, seq_len)
    pos = 0
    for start, length in spans:
        if start < pos or length < 1 or start + length > seq_len:
            raise ValueError(
                f"spans must be sorted, non-overlapping (start, length >= 1) inside "
                f"[0, {seq_len}], got {list(spans)}"
            )
        pos = start + length
        lts[start:pos] = np.arange(start, pos)
        lte[start:pos] = pos
    return _mask([np.stack([lts, lte], axis=-1)] * batch, heads, causal=True)


# --------------------------------------------------------------------------------------------
# The mask a run gives each packed document (`attention.mask` and its parameters).
# --------------------------------------------------------------------------------------------

DOCUMENT_MASKS: tuple[str, ...] = ("causal", "sliding_window", "global_window", "prefix_lm")
"""What a language-model run can give each packed document (`DocumentMasking.kind`)."""


@dataclass(frozen=True)
class DocumentMasking:
    """The mask of every packed document of a sequence (none sees another document):

    * `causal`: the earlier tokens of its document (`causal_document_mask`);
    * `sliding_window`: the last `window` of them, itself included
      (`sliding_window_document_mask`);
    * `global_window`: those and the document's first `global_tokens` tokens (the same);
    * `prefix_lm`: the whole prefix (bidirectional), then causal (`prefix_lm_document_mask`;
      each segment's prefix length given to `build`).
    """

    kind: str = "causal"
    window: int | None = None
    global_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DOCUMENT_MASKS:
            raise ValueError(f"document mask {self.kind!r}: expected one of {DOCUMENT_MASKS}")
        if self.windowed and (self.window is None or self.window < 1):
            raise ValueError(f"a {self.kind} mask needs a window >= 1, got {self.window}")
        if self.kind == "global_window" and self.global_tokens < 1:
            raise ValueError(f"a global_window mask needs global_tokens >= 1, got "
                             f"{self.global_tokens}")  # fmt: skip

    @property
    def windowed(self) -> bool:
        """Whether a token sees only a window of its document."""
        return self.kind in ("sliding_window", "global_window")

    def describe(self) -> str:
        """`sliding_window 4096` / `global_window 4 + 4096` / `prefix_lm` / `causal`."""
        if self.kind == "sliding_window":
            return f"sliding_window {self.window}"
        if self.kind == "global_window":
            return f"global_window {self.global_tokens} + {self.window}"
        return self.kind

    @property
    def uses_prefixes(self) -> bool:
        """Whether `build` reads each segment's prefix length."""
        return self.kind == "prefix_lm"

    def build(
        self,
        doc_lens: Sequence[Sequence[int]],
        prefix_lens: Sequence[Sequence[int]] | None = None,
        heads: int = 1,
    ) -> Mask:
        """The `[B, heads, S, C]` mask of B rows of segments `doc_lens[b]` (prefix_lm: with
        their prefix lengths `prefix_lens[b]`, 0 for none)."""
        batch = len(doc_lens)
        if self.kind == "causal":
            return causal_document_mask(doc_lens, batch=batch, heads=heads)
        if self.windowed:
            extra = self.global_tokens if self.kind == "global_window" else 0
            return sliding_window_document_mask(
                doc_lens, int(self.window or 0), global_tokens=extra, batch=batch, heads=heads
            )
        if prefix_lens is None:
            raise ValueError("a prefix_lm mask needs each segment's prefix length")
        return prefix_lm_document_mask(doc_lens, prefix_lens, batch=batch, heads=heads)
