"""Rewrite a global FlashMask mask for one CP rank's local query rows.

Under all-gather-KV context parallelism every rank attends its local queries against the full,
gathered key sequence. The global mask `startend_row_indices` `[B, Hm, S, C]` therefore keeps
its columns (global key positions, matching the gathered K) and only its *values*, which are
global query-row thresholds, need rewriting.

A rank's local rows have global positions p_0 < p_1 < ... < p_{L-1} (increasing because each
rank's chunk list is sorted). For a threshold g, "global row >= g" holds for exactly the local
rows l >= t and "global row < g" for l < t, where

    t = #{ l : p_l < g }          (a binary search: `np.searchsorted(p, g)`)

so every column (LTS, LTE, UTS, UTE) maps element-wise and exactly. A threshold g >= S (upstream
FlashMask's "through the last row", e.g. a mask filled with Sk; see `flashcp.mask_indices`) counts
every local row, t = L: through the last local row, the same as g = S. For the dual-chunk layout
this is PaddleFleet's `preprocess_index_dual_chunks` ("max of two clips, keep 0", reference §2.2)
and for the contiguous layout `clip(g − r·L, 0, L)`; the tests check both equalities.

FlashMask's built-in `causal=True` is aligned to the bottom-right corner when Sq != Sk and
assumes contiguous rows, so CP always runs with `causal=False`: causal masks are first made
non-causal (`mask_indices.to_noncausal`: `[LTS]` → `[LTS, UTE=j]`, `[LTS, LTE]` →
`[LTS, LTE, 0, j]`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.cp.layout import Assignment
from flashcp.mask_indices import as_numpy, to_noncausal

__all__ = ["local_positions", "rebase_mask", "rebase_rows", "rebase_thresholds"]


def local_positions(
    assignment_or_positions: Assignment | Any, seq_len: int, rank: int | None = None
) -> np.ndarray:
    """Global positions (int64) of a rank's local rows, validated strictly increasing."""
    if isinstance(assignment_or_positions, Assignment):
        if rank is None:
            raise ValueError("rank is required when an Assignment is given")
        return assignment_or_positions.positions(seq_len, rank)
    pos = np.asarray(as_numpy(assignment_or_positions)).astype(np.int64).reshape(-1)
    if pos.size and (pos[0] < 0 or pos[-1] >= seq_len):
        raise ValueError(f"positions must lie in [0, {seq_len}), got [{pos.min()}, {pos.max()}]")
    if np.any(np.diff(pos) <= 0):
        raise ValueError(
            "local positions must be strictly increasing: a global threshold maps to a single "
            "local threshold only then (keep each rank's chunk list sorted by chunk id)"
        )
    return pos


def rebase_thresholds(values: Any, positions: np.ndarray) -> np.ndarray:
    """Map global row thresholds to local ones: t = number of local rows with global row < g."""
    g = np.asarray(as_numpy(values))
    return np.searchsorted(positions, g, side="left").astype(np.int32)


def rebase_rows(thresholds: Any, start: int, stop: int) -> Any:
    """Local row thresholds → thresholds over the local rows `[start, stop)` alone (a chunk of
    query rows run in one kernel call, `flashcp.attention.allgather_kv_chunked`).

    This is `rebase_thresholds(t, np.arange(start, stop))` — for contiguous rows the count of
    rows below t is `clip(t - start, 0, stop - start)` — written with `-` and `.clip` only, so
    it runs on a numpy array on the host or on a paddle int32 tensor on the device alike.
    Columns are untouched: slice them first (any subset of key columns keeps its meaning).
    """
    if not 0 <= start <= stop:
        raise ValueError(f"rows [{start}, {stop}) are not a range of local rows")
    return (thresholds - start).clip(0, stop - start)


def rebase_mask(
    indices: Any,
    *,
    causal: bool,
    assignment_or_positions: Assignment | Any,
    rank: int | None = None,
) -> np.ndarray:
    """The non-causal mask for a rank's local query rows against all S global keys.

    Args:
        indices: global `startend_row_indices` `[B, Hm, S, C]` (numpy or paddle), values are
            global query rows.
        causal: the FlashMask causal flag the global mask is meant for.
        assignment_or_positions: an `Assignment` (then `rank` is required) or the rank's local
            rows' global positions, strictly increasing.
        rank: the CP rank, with an `Assignment`.

    Returns:
        int32 `[B, Hm, S, C']` with C' = 2 or 4, to be used with `causal=False` and
        Sq = local length: `to_dense(out, causal=False, q_len=L)` equals the global dense mask's
        rows at the rank's positions.
    """
    idx = np.asarray(as_numpy(indices))
    if idx.ndim != 4:
        raise ValueError(f"startend_row_indices must be rank 4 [B, Hm, Sk, C], got {idx.shape}")
    pos = local_positions(assignment_or_positions, idx.shape[2], rank)
    return rebase_thresholds(to_noncausal(idx, causal=causal), pos)
