"""FlashMask's column-wise mask format (`startend_row_indices`): what its values mean, the dense
oracle (`to_dense`), the tile classes the kernels and the CP balancer read (`classify_tiles`),
the causal-to-non-causal rewrite CP needs (`to_noncausal`) and the checks (`validate`).

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

These are functions of the raw indices (numpy, or a Paddle tensor read as numpy), the one
definition every kernel, CP layout and test reads them by; the `Mask` record and the builders,
one per mask family, are `flashcp.masks`.
"""

from __future__ import annotations

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
