"""The tiling plan shared by the CPU reference forward and backward.

The plan is built once per kernel call from the FlashMask column mask. It says, per batch row
b, mask head m and query block i, which key columns to visit and where the exact mask must be
applied:

* tiles are classified once by `flashcp.mask_indices.classify_tiles` (per-block min/max of the mask
  columns): TILE_MASKED tiles are skipped, TILE_FULL tiles get no mask math, and only
  TILE_PARTIAL tiles build a boolean mask, just for their own rows and columns;
* adjacent non-masked key blocks are merged into one *segment* (one matmul), capped at
  `max_merge_cols` columns so scratch memory stays bounded (linear in S overall);
* query heads that share a mask head form one *head unit*, processed together (Hm = 1 means
  every head shares the tiles; Hm = Hkv or Hq gives one unit per mask head).

No array of size Sq x Sk is ever built: the tile table is (Sq/block_q) x (Sk/block_k) and the
largest scratch is `heads x block_q x max_merge_cols`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcp.mask_indices import TILE_MASKED, TILE_PARTIAL, classify_tiles, clip_rows

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
DEFAULT_MAX_MERGE_COLS = 1024


@dataclass(frozen=True)
class Segment:
    """Key columns `[k0, k1)` visited in one matmul, and the sub-ranges needing the mask."""

    k0: int
    k1: int
    partial: tuple[tuple[int, int], ...]  # absolute column ranges [c0, c1) of PARTIAL tiles


@dataclass(frozen=True)
class HeadUnit:
    """Query heads `[q0, q1)` that share mask head `mask_head`, grouped by their KV head.

    Arrays with a leading query-head axis are viewed as `[n_kv, group, ...]`; the matching KV
    heads are `[kv0, kv0 + n_kv)`. Each KV head serves `group` consecutive query heads here.
    """

    mask_head: int
    q0: int
    q1: int
    kv0: int
    n_kv: int
    group: int

    def q_view(self, arr: np.ndarray) -> np.ndarray:
        """`arr[q0:q1]` (leading axis = query heads) as a `[n_kv, group, ...]` view."""
        return arr[self.q0 : self.q1].reshape(self.n_kv, self.group, *arr.shape[1:])

    def kv_view(self, arr: np.ndarray) -> np.ndarray:
        """`arr[kv0:kv0+n_kv]` (leading axis = KV heads)."""
        return arr[self.kv0 : self.kv0 + self.n_kv]


def head_units(num_q_heads: int, num_kv_heads: int, mask_heads: int) -> list[HeadUnit]:
    """One unit per mask head; query head h uses mask head `h // (Hq // Hm)`."""
    if num_q_heads % num_kv_heads or num_q_heads % mask_heads:
        raise ValueError(
            f"heads do not divide: Hq={num_q_heads}, Hkv={num_kv_heads}, Hm={mask_heads}"
        )
    g = num_q_heads // num_kv_heads
    per_unit = num_q_heads // mask_heads
    units = []
    for m in range(mask_heads):
        q0, q1 = m * per_unit, (m + 1) * per_unit
        if per_unit % g == 0:  # whole KV groups (Hm = 1 or Hm = Hkv)
            units.append(HeadUnit(m, q0, q1, q0 // g, per_unit // g, g))
        elif g % per_unit == 0:  # part of one KV group (Hm = Hq with GQA)
            units.append(HeadUnit(m, q0, q1, q0 // g, 1, per_unit))
        else:
            raise ValueError(
                f"mask heads Hm={mask_heads} do not align with KV groups (Hq={num_q_heads}, "
                f"Hkv={num_kv_heads}): use Hm = 1, Hkv or Hq."
            )
    return units


def column_ranges(
    idx: np.ndarray, causal: bool, q_len: int
) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """Masked row ranges `[start, end)` per column; None stands for 0 (start) or Sq (end).

    Mirrors the table in `flashcp.mask_indices`: causal [LTS] / [LTS, LTE]; non-causal [LTS, UTE] /
    [LTS, LTE, UTS, UTE].
    """
    ncol = idx.shape[-1]
    cols = [idx[..., c].astype(np.int64) for c in range(ncol)]
    if causal and ncol == 1:
        return [(cols[0], None)]
    if causal and ncol == 2:
        return [(cols[0], cols[1])]
    if not causal and ncol == 2:
        return [(cols[0], None), (None, cols[1])]
    if not causal and ncol == 4:
        return [(cols[0], cols[1]), (cols[2], cols[3])]
    raise ValueError(
        f"startend_row_indices has {ncol} columns, which is not valid with causal={causal}: "
        "causal masks take 1 or 2 columns, non-causal masks take 2 or 4."
    )


def heads_first(x: np.ndarray, scale: float | None = None) -> np.ndarray:
    """`[B, S, H, X]` -> a new contiguous `[B, H, S, X]`, optionally multiplied by `scale`.

    Always a copy (even when the transpose is already contiguous), so the caller's array is
    never scaled in place.
    """
    out = np.array(x.transpose(0, 2, 1, 3), order="C", copy=True)
    if scale is not None:
        out *= out.dtype.type(scale)
    return out


def heads_first_augmented(x: np.ndarray, last: float | np.ndarray) -> np.ndarray:
    """`[B, S, H, X]` -> a new contiguous `[B, H, S, X + 1]` whose extra last column is `last`
    (a scalar, or `[B, H, S]`).

    A GEMM against such an operand does a rank-one update for free: `[A, a] [B, 1]ᵀ = A Bᵀ + a`
    subtracts a per-row value inside the matmul (the backward's LSE and D), and `P [V, 1]`
    gives `P V` and P's row sums in one product (the forward's softmax denominator), saving
    a pass of numpy element-wise work over every score tile.
    """
    b, s, h, n = x.shape
    out = np.empty((b, h, s, n + 1), dtype=x.dtype)
    out[..., :n] = x.transpose(0, 2, 1, 3)
    out[..., n] = last
    return out


class TilePlan:
    """Which tiles to visit and how to mask them, for one kernel call (forward or backward)."""

    def __init__(
        self,
        startend_row_indices: np.ndarray | None,
        *,
        batch: int,
        q_len: int,
        k_len: int,
        causal: bool,
        block_q: int = DEFAULT_BLOCK_Q,
        block_k: int = DEFAULT_BLOCK_K,
        max_merge_cols: int = DEFAULT_MAX_MERGE_COLS,
    ) -> None:
        if block_q <= 0 or block_k <= 0 or max_merge_cols <= 0:
            raise ValueError("block_q, block_k and max_merge_cols must be positive")
        self.q_len = q_len
        self.k_len = k_len
        self.causal = causal
        self.block_q = block_q
        self.block_k = block_k
        self.max_blocks = max(1, max_merge_cols // block_k)
        self.causal_offset = k_len - q_len
        if startend_row_indices is None:
            # No column mask: classify with a mask that masks nothing, so only `causal` counts.
            idx = np.full((1, 1, k_len, 1 if causal else 2), q_len, dtype=np.int32)
            if not causal:
                idx[..., 1] = 0
            self.ranges: list[tuple[np.ndarray | None, np.ndarray | None]] = []
        else:
            # Upstream FlashMask reads any value >= Sq as "through the last row" (Paddle's
            # `flashmask_attention` docstring; see `flashcp.mask_indices`), e.g. a causal mask for
            # Sq != Sk filled with Sk. Writing such values as Sq once, here, means the mask and
            # its clipped form take the same code path and give bitwise-equal results.
            idx = clip_rows(np.asarray(startend_row_indices), q_len)
            self.ranges = column_ranges(idx, causal, q_len)
        self.mask_batch = idx.shape[0]
        if self.mask_batch not in (1, batch):
            raise ValueError(
                f"startend_row_indices has batch {self.mask_batch} but the inputs have {batch}"
            )
        self.mask_heads = idx.shape[1]
        self.tiles = classify_tiles(
            idx, causal=causal, q_len=q_len, block_q=block_q, block_k=block_k
        )
        self.num_q_blocks = self.tiles.shape[2]
        self._segments: dict[tuple[int, int], list[list[Segment]]] = {}

    def _b(self, b: int) -> int:
        return 0 if self.mask_batch == 1 else b

    def rows(self, i: int) -> tuple[int, int]:
        """Query rows `[r0, r1)` of query block i."""
        r0 = i * self.block_q
        return r0, min(r0 + self.block_q, self.q_len)

    def segments(self, b: int, m: int, i: int) -> list[Segment]:
        """The merged key segments query block i visits for batch b, mask head m."""
        key = (self._b(b), m)
        table = self._segments.get(key)
        if table is None:
            tiles = self.tiles[key[0], m]
            table = [self._row_segments(tiles[qi]) for qi in range(self.num_q_blocks)]
            self._segments[key] = table
        return table[i]

    def _row_segments(self, row: np.ndarray) -> list[Segment]:
        active = np.concatenate(([0], (row != TILE_MASKED).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(active))
        bk = self.block_k
        out = []
        for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            for cs in range(start, end, self.max_blocks):
                ce = min(cs + self.max_blocks, end)
                part = np.concatenate(([0], (row[cs:ce] == TILE_PARTIAL).astype(np.int8), [0]))
                pe = np.flatnonzero(np.diff(part))
                partial = tuple(
                    ((cs + p0) * bk, min((cs + p1) * bk, self.k_len))
                    for p0, p1 in zip(pe[::2].tolist(), pe[1::2].tolist(), strict=True)
                )
                out.append(Segment(cs * bk, min(ce * bk, self.k_len), partial))
        return out

    def tile_mask(self, b: int, m: int, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """The exact boolean mask (True = masked) of rows `[r0, r1)` x columns `[c0, c1)`."""
        bb = self._b(b)
        rows = np.arange(r0, r1).reshape(-1, 1)
        masked = np.zeros((r1 - r0, c1 - c0), dtype=bool)
        for start, end in self.ranges:
            if start is None:
                assert end is not None
                masked |= rows < end[bb, m, c0:c1]
            elif end is None:
                masked |= rows >= start[bb, m, c0:c1]
            else:
                masked |= (rows >= start[bb, m, c0:c1]) & (rows < end[bb, m, c0:c1])
        if self.causal:
            masked |= rows < (np.arange(c0, c1) - self.causal_offset)
        return masked

    def apply_mask(self, s: np.ndarray, b: int, m: int, r0: int, r1: int, seg: Segment) -> None:
        """Set the masked scores of a segment's PARTIAL tiles to -inf, in place.

        `s` is `[n_kv, group, rows, k1 - k0]`; each tile mask `[rows, cols]` broadcasts over
        the heads of the unit. FULL tiles of the segment are left untouched.
        """
        for c0, c1 in seg.partial:
            mask = self.tile_mask(b, m, r0, r1, c0, c1)
            np.copyto(s[..., c0 - seg.k0 : c1 - seg.k0], -np.inf, where=mask)

    def stats(self) -> dict[str, int]:
        """Tile counts by class (summed over batch and mask heads), for benchmarks and logs."""
        counts = np.bincount(self.tiles.ravel().astype(np.int64), minlength=3)
        return {"masked": int(counts[0]), "partial": int(counts[1]), "full": int(counts[2])}
