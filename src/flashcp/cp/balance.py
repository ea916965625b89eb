"""Workload-balanced CP: assign query chunks to ranks so every rank does the same attention work.

Dual-chunk (rank r holds chunks r and 2P−1−r) balances a plain causal mask exactly, but not
document, share-question or sliding-window masks, whose work per query row is not the
triangle's. The balanced mode measures each chunk's work from the mask and assigns chunks to
ranks (equal chunk counts, so every rank's local Q/O/LSE tensors have the same shape).

**Work unit: computed tiles.** FlashMask classifies each (q-block, k-block) tile from
per-block min/max of the mask columns and skips fully masked tiles; every other tile costs a
full block matmul pair (partial tiles add element-wise masking). So the kernel's cost tracks
the number of non-skipped tiles, not the number of unmasked (row, column) pairs: a tile with
one visible entry costs as much as a full one. `unit="tiles"` (default) counts them with
`mask_indices.classify_tiles` on each chunk's rebased mask; `unit="pairs"` counts unmasked pairs in
O(S·C) per chunk (no dense S×S array) for comparison. `partial_weight` lets a partial tile
cost more than an unmasked one if a kernel's profile says so.

**Assignment: greedy LPT + swap search, deterministic.** Chunks are taken heaviest first (ties:
lower chunk id) and given to the least-loaded rank that still has room (ties: lower rank);
then pairs of chunks are swapped between the most-loaded rank and another rank while that
lowers the pair's maximum below the current maximum. Everything is integer/float arithmetic on
the global mask with stable tie-breaking, so every rank computes the same assignment without
communication. For batch > 1 all sequences share one assignment: work is summed over the batch
(and over mask heads).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from flashcp.cp.layout import Assignment
from flashcp.cp.rebase import rebase_mask
from flashcp.mask_indices import TILE_MASKED, TILE_PARTIAL, as_numpy, classify_tiles

__all__ = [
    "assign_chunks",
    "assignment_loads",
    "balanced_assignment",
    "chunk_work",
    "imbalance",
    "rank_work",
]

WorkUnit = Literal["tiles", "pairs"]
DEFAULT_BLOCK = 128
MAX_SWAP_ROUNDS = 10_000


def _rows_work(
    idx: np.ndarray,
    rows: np.ndarray,
    *,
    causal: bool,
    block: int,
    unit: WorkUnit,
    partial_weight: float,
) -> float:
    """Work of the query rows at global positions `rows` (sorted) against all keys."""
    local = rebase_mask(idx, causal=causal, assignment_or_positions=rows)
    n = rows.size
    if unit == "tiles":
        tiles = classify_tiles(local, causal=False, q_len=n, block_q=block, block_k=block)
        partial = int(np.count_nonzero(tiles == TILE_PARTIAL))
        computed = int(np.count_nonzero(tiles != TILE_MASKED))
        return float(computed - partial + partial_weight * partial)
    if unit == "pairs":
        return float(_unmasked_pairs(local, n))
    raise ValueError(f"unit must be 'tiles' or 'pairs', got {unit!r}")


def _unmasked_pairs(local: np.ndarray, n: int) -> int:
    """Unmasked (row, column) pairs of a non-causal mask over n rows, without densifying."""
    v = np.clip(local.astype(np.int64), 0, n)
    if v.shape[-1] == 2:  # masked: [LTS, n) ∪ [0, UTE)
        a, b, c, d = v[..., 0], np.full_like(v[..., 0], n), np.zeros_like(v[..., 1]), v[..., 1]
    else:  # masked: [LTS, LTE) ∪ [UTS, UTE)
        a, b, c, d = v[..., 0], v[..., 1], v[..., 2], v[..., 3]
    first = np.maximum(b - a, 0)
    second = np.maximum(d - c, 0)
    both = np.maximum(np.minimum(b, d) - np.maximum(a, c), 0)
    masked = first + second - both
    return int((n - masked).sum())


def chunk_work(
    indices: Any,
    *,
    causal: bool,
    num_chunks: int,
    block: int = DEFAULT_BLOCK,
    unit: WorkUnit = "tiles",
    partial_weight: float = 1.0,
) -> np.ndarray:
    """Work of each of `num_chunks` equal query-row chunks against all keys, float64 `[N]`.

    Summed over the batch and the mask heads. With `unit="tiles"` the chunk's rows are tiled
    on their own (q-blocks of `block` rows starting at the chunk start); when the chunk
    length is a multiple of `block` this is exactly the kernel's tile count for those rows.
    """
    idx = np.asarray(as_numpy(indices))
    s = idx.shape[2]
    c = Assignment.contiguous(num_chunks).chunk_len(s)
    return np.array(
        [
            _rows_work(
                idx,
                np.arange(k * c, (k + 1) * c, dtype=np.int64),
                causal=causal,
                block=block,
                unit=unit,
                partial_weight=partial_weight,
            )
            for k in range(num_chunks)
        ],
        dtype=np.float64,
    )


def assignment_loads(work: np.ndarray, assignment: Assignment) -> np.ndarray:
    """Per-rank sum of per-chunk `work` under `assignment` (float64 `[world]`)."""
    work = np.asarray(work, dtype=np.float64)
    if work.shape != (assignment.num_chunks,):
        raise ValueError(
            f"work has shape {work.shape}, expected ({assignment.num_chunks},) for this assignment"
        )
    return np.array([work[list(chunks)].sum() for chunks in assignment.ranks], dtype=np.float64)


def rank_work(
    indices: Any,
    *,
    causal: bool,
    assignment: Assignment,
    block: int = DEFAULT_BLOCK,
    unit: WorkUnit = "tiles",
    partial_weight: float = 1.0,
) -> np.ndarray:
    """Each rank's work exactly as its kernel call sees it, float64 `[world]`.

    The rank's local rows (all its chunks, concatenated) are tiled together against the
    rebased mask, so tiles straddling two chunks are counted as the kernel would. Equals
    `assignment_loads(chunk_work(...), assignment)` when the chunk length is a multiple of
    `block`.
    """
    idx = np.asarray(as_numpy(indices))
    s = idx.shape[2]
    return np.array(
        [
            _rows_work(
                idx,
                assignment.positions(s, r),
                causal=causal,
                block=block,
                unit=unit,
                partial_weight=partial_weight,
            )
            for r in range(assignment.world)
        ],
        dtype=np.float64,
    )


def imbalance(work_per_rank: Any) -> float:
    """max / mean of per-rank work (1.0 = perfect balance; 1.0 when there is no work)."""
    w = np.asarray(work_per_rank, dtype=np.float64)
    mean = float(w.mean()) if w.size else 0.0
    return float(w.max()) / mean if mean > 0 else 1.0


def _best_swap(
    w: np.ndarray, ranks: list[list[int]], loads: np.ndarray
) -> tuple[int, int, int, int] | None:
    """The swap `(m, r, i, j)` of chunk `ranks[m][i]` and `ranks[r][j]` that lowers a most-loaded
    rank m the most while keeping both ranks strictly below the current maximum, or None.

    Each accepted swap removes one rank from the maximum without adding one, so the search
    terminates; ties go to the lowest (m, r, i, j).
    """
    top = loads.max()
    best: tuple[float, int, int, int, int] | None = None  # (new pair max, m, r, i, j)
    for m in np.flatnonzero(loads == top):
        for r in range(len(ranks)):
            if loads[r] == top:
                continue
            for i, a in enumerate(ranks[m]):
                for j, b in enumerate(ranks[r]):
                    delta = w[a] - w[b]
                    if delta <= 0:
                        continue
                    pair_max = max(top - delta, loads[r] + delta)
                    if pair_max < top and (best is None or pair_max < best[0]):
                        best = (pair_max, int(m), r, i, j)
    return None if best is None else best[1:]


def assign_chunks(work: Any, world: int, *, max_rounds: int = MAX_SWAP_ROUNDS) -> Assignment:
    """Assign `len(work)` chunks to `world` ranks, equal counts, minimising the max load.

    Deterministic: greedy LPT under the count constraint (heaviest chunk first, ties by chunk
    id; least-loaded rank with room, ties by rank id), then best-improvement pair swaps
    between a most-loaded rank and any other rank while that strictly lowers both ranks
    below the current maximum (`max_rounds` bounds the swaps; 0 gives plain LPT). Ranks are
    finally ordered by their lowest chunk id.
    """
    w = np.asarray(work, dtype=np.float64).reshape(-1)
    n = w.size
    if world < 1 or n % world:
        raise ValueError(f"{n} chunks cannot be split equally over {world} ranks")
    k = n // world
    order = sorted(range(n), key=lambda c: (-w[c], c))
    ranks: list[list[int]] = [[] for _ in range(world)]
    loads = np.zeros(world, dtype=np.float64)
    for c in order:
        room = [r for r in range(world) if len(ranks[r]) < k]
        r = min(room, key=lambda r: (loads[r], r))
        ranks[r].append(c)
        loads[r] += w[c]

    for _ in range(max_rounds):
        swap = _best_swap(w, ranks, loads)
        if swap is None:
            break
        m, r, i, j = swap
        a, b = ranks[m][i], ranks[r][j]
        ranks[m][i], ranks[r][j] = b, a
        loads[m] += w[b] - w[a]
        loads[r] += w[a] - w[b]

    lists = sorted((sorted(chunks) for chunks in ranks), key=lambda chunks: chunks[0])
    return Assignment(ranks=tuple(tuple(chunks) for chunks in lists), num_chunks=n)


def balanced_assignment(
    indices: Any,
    *,
    causal: bool,
    world: int,
    chunks_per_rank: int = 2,
    block: int = DEFAULT_BLOCK,
    unit: WorkUnit = "tiles",
    partial_weight: float = 1.0,
) -> Assignment:
    """The workload-balanced assignment of `world·chunks_per_rank` chunks for this mask.

    Every rank calls this with the same global mask and gets the same result. Raises
    `ValueError` (naming `data.seq_len`) when S is not divisible by the chunk count.
    """
    world, k = int(world), int(chunks_per_rank)
    if world < 1 or k < 1:
        raise ValueError(f"world and chunks_per_rank must be >= 1, got {world} and {k}")
    # Check divisibility up front so the error names this layout's chunk count.
    blocked = tuple(tuple(range(r * k, (r + 1) * k)) for r in range(world))
    Assignment(ranks=blocked, num_chunks=world * k).chunk_len(np.shape(indices)[2])
    work = chunk_work(
        indices,
        causal=causal,
        num_chunks=world * k,
        block=block,
        unit=unit,
        partial_weight=partial_weight,
    )
    return assign_chunks(work, world)
