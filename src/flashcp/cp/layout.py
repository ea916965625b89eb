"""Sequence layouts for context parallelism: which global tokens each CP rank holds.

The global sequence of length S is cut into `num_chunks` equal chunks of `S // num_chunks`
tokens. An `Assignment` gives every rank an ordered list of chunk ids, all ranks holding the
same number of chunks, each chunk held by exactly one rank. A rank's local sequence is the
concatenation of its chunks in that order. The two classic layouts are special cases:

* dual-chunk ("DualChunkSwap", Llama 3 / PaddleFleet `scatter_balance`): 2·P chunks, rank r
  holds chunks r and 2P−1−r. It balances causal attention work exactly.
* contiguous: P chunks, rank r holds chunk r.

The workload-balanced mode (`flashcp.cp.balance`) builds a general assignment from the mask.

Chunk lists are kept sorted by chunk id so a rank's local tokens are in increasing global
order: that is what lets a global mask threshold map to a single local threshold
(`flashcp.cp.rebase`). Every function here works on numpy arrays and paddle Tensors alike
(paddle is imported only when a Tensor is passed), along any axis; slicing and concatenation
are differentiable paddle ops, so the shard/unshard pair can sit inside autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashcp.mask_indices import as_numpy

__all__ = [
    "Assignment",
    "assigned_positions",
    "chunk_bounds",
    "contiguous_positions",
    "dualchunk_positions",
    "pad_mask",
    "pad_to_multiple",
    "padded_length",
    "shard_assigned",
    "shard_contiguous",
    "shard_dualchunk",
    "unshard_assigned",
    "unshard_contiguous",
    "unshard_dualchunk",
]


@dataclass(frozen=True)
class Assignment:
    """Which chunks of the global sequence each CP rank holds, in local order.

    `ranks[r]` is rank r's chunk ids, strictly increasing; together the lists cover
    `range(num_chunks)` exactly once and all have the same length (`chunks_per_rank`).
    Build with `Assignment.dualchunk(world)`, `Assignment.contiguous(world)` or
    `Assignment.from_lists(...)`; the balanced mode builds one from the mask.
    """

    ranks: tuple[tuple[int, ...], ...]
    num_chunks: int

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("an Assignment needs at least one rank")
        counts = {len(chunks) for chunks in self.ranks}
        if len(counts) != 1 or 0 in counts:
            sizes = [len(chunks) for chunks in self.ranks]
            raise ValueError(
                f"every rank must hold the same, non-zero number of chunks; got sizes {sizes}"
            )
        flat = sorted(c for chunks in self.ranks for c in chunks)
        if flat != list(range(self.num_chunks)):
            raise ValueError(
                f"the chunk lists must cover chunks 0..{self.num_chunks - 1} exactly once; "
                f"got {[list(chunks) for chunks in self.ranks]}"
            )
        for r, chunks in enumerate(self.ranks):
            if any(a >= b for a, b in zip(chunks, chunks[1:], strict=False)):
                raise ValueError(
                    f"rank {r}'s chunks {list(chunks)} are not in increasing order: local "
                    "tokens must stay in increasing global order for mask rebasing"
                )

    @classmethod
    def from_lists(cls, ranks: Sequence[Sequence[int]]) -> Assignment:
        """An assignment from per-rank chunk id lists (each list is sorted here)."""
        lists = tuple(tuple(sorted(int(c) for c in chunks)) for chunks in ranks)
        return cls(ranks=lists, num_chunks=sum(len(chunks) for chunks in lists))

    @classmethod
    def dualchunk(cls, world: int) -> Assignment:
        """DualChunkSwap: 2·world chunks, rank r holds chunks r and 2·world−1−r."""
        _check_world(world)
        return cls(ranks=tuple((r, 2 * world - 1 - r) for r in range(world)), num_chunks=2 * world)

    @classmethod
    def contiguous(cls, world: int) -> Assignment:
        """Contiguous: world chunks, rank r holds chunk r."""
        _check_world(world)
        return cls(ranks=tuple((r,) for r in range(world)), num_chunks=world)

    @property
    def world(self) -> int:
        """Number of CP ranks."""
        return len(self.ranks)

    @property
    def chunks_per_rank(self) -> int:
        """Number of chunks each rank holds."""
        return len(self.ranks[0])

    def owners(self) -> np.ndarray:
        """`owners()[c]` is the rank holding chunk c (int64 `[num_chunks]`)."""
        out = np.empty(self.num_chunks, dtype=np.int64)
        for r, chunks in enumerate(self.ranks):
            out[list(chunks)] = r
        return out

    def divisor_text(self) -> str:
        """How the chunk count is derived, for error messages ('2·cp = 8')."""
        p, k, n = self.world, self.chunks_per_rank, self.num_chunks
        if k == 1:
            return f"cp = {n}"
        if k == 2:
            return f"2·cp = {n}"
        return f"cp·chunks_per_rank = {p}·{k} = {n}"

    def chunk_len(self, seq_len: int) -> int:
        """Tokens per chunk; `ValueError` naming the config keys when S is not divisible."""
        seq_len = int(seq_len)
        n = self.num_chunks
        if seq_len <= 0 or seq_len % n:
            suggestion = max(n, -(-seq_len // n) * n)
            raise ValueError(
                f"seq_len {seq_len} is not divisible by {self.divisor_text()}: set data.seq_len "
                f"to a multiple of {n} (e.g. {seq_len}→{suggestion}) or set parallel.pad: true"
            )
        return seq_len // n

    def positions(self, seq_len: int, rank: int) -> np.ndarray:
        """Global positions (int64) of `rank`'s local tokens, in local order."""
        c = self.chunk_len(seq_len)
        chunks = self._rank_chunks(rank)
        return np.concatenate([np.arange(k * c, (k + 1) * c, dtype=np.int64) for k in chunks])

    def runs(self, rank: int) -> list[tuple[int, int]]:
        """`rank`'s chunks merged into maximal runs `[(first_chunk, n_chunks), ...]`."""
        out: list[tuple[int, int]] = []
        for k in self._rank_chunks(rank):
            if out and out[-1][0] + out[-1][1] == k:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((k, 1))
        return out

    def _rank_chunks(self, rank: int) -> tuple[int, ...]:
        if not 0 <= int(rank) < self.world:
            raise ValueError(f"rank {rank} is out of range for a CP world of {self.world}")
        return self.ranks[int(rank)]


def chunk_bounds(count: int, chunk: int) -> list[tuple[int, int]]:
    """`[start, stop)` of consecutive chunks of at most `chunk` rows covering `count` rows
    (the loss's token chunks, a layer's tiles, chunked attention's query and key chunks)."""
    return [(start, min(start + chunk, count)) for start in range(0, count, chunk)]


def _check_world(world: int) -> None:
    if int(world) < 1:
        raise ValueError(f"the CP world size must be >= 1, got {world}")


# ---------------------------------------------------------------------------------------------
# Array helpers: one code path for numpy and paddle.


def _is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _norm_axis(x: Any, axis: int) -> int:
    ndim = len(x.shape)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def _slice(x: Any, axis: int, start: int, stop: int) -> Any:
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _concat_copy(pieces: list[Any], axis: int) -> Any:
    """Concatenate into a fresh buffer (never a view of the input)."""
    if _is_numpy(pieces[0]):
        return np.concatenate(pieces, axis=axis) if len(pieces) > 1 else pieces[0].copy()
    import paddle

    return paddle.concat(pieces, axis=axis) if len(pieces) > 1 else pieces[0].clone()


# ---------------------------------------------------------------------------------------------
# General (assignment) form.


def shard_assigned(x: Any, rank: int, assignment: Assignment, axis: int = 1) -> Any:
    """Rank `rank`'s local part of the global `x`: its chunks along `axis`, concatenated.

    Returns a copy so the full tensor can be freed (slices would keep it alive). Adjacent
    chunks are copied as one slice.
    """
    axis = _norm_axis(x, axis)
    c = assignment.chunk_len(x.shape[axis])
    pieces = [_slice(x, axis, k * c, (k + n) * c) for k, n in assignment.runs(rank)]
    return _concat_copy(pieces, axis)


def unshard_assigned(shards: Sequence[Any], assignment: Assignment, axis: int = 1) -> Any:
    """The global tensor from every rank's local part (given in rank order); inverse of shard."""
    if len(shards) != assignment.world:
        raise ValueError(f"expected {assignment.world} shards (one per rank), got {len(shards)}")
    axis = _norm_axis(shards[0], axis)
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"all ranks' shards must have the same shape, got {sorted(shapes)}")
    local = shards[0].shape[axis]
    k = assignment.chunks_per_rank
    if local % k:
        raise ValueError(f"local length {local} is not divisible by chunks_per_rank {k}")
    c = local // k
    by_chunk: dict[int, Any] = {}
    for shard, chunks in zip(shards, assignment.ranks, strict=True):
        for i, chunk in enumerate(chunks):
            by_chunk[chunk] = _slice(shard, axis, i * c, (i + 1) * c)
    return _concat_copy([by_chunk[chunk] for chunk in range(assignment.num_chunks)], axis)


def assigned_positions(seq_len: int, rank: int, assignment: Assignment) -> np.ndarray:
    """Global positions (int64) of `rank`'s local tokens, e.g. for rotary embeddings."""
    return assignment.positions(seq_len, rank)


# ---------------------------------------------------------------------------------------------
# Dual-chunk and contiguous: the two named special cases.


def shard_dualchunk(x: Any, rank: int, world: int, axis: int = 1) -> Any:
    """Chunks `rank` and `2·world−1−rank` of 2·world along `axis`, concatenated (a copy)."""
    return shard_assigned(x, rank, Assignment.dualchunk(world), axis)


def unshard_dualchunk(shards: Sequence[Any], world: int, axis: int = 1) -> Any:
    """Inverse of `shard_dualchunk`, given all ranks' shards in rank order."""
    return unshard_assigned(shards, Assignment.dualchunk(world), axis)


def dualchunk_positions(seq_len: int, rank: int, world: int) -> np.ndarray:
    """Global positions (int64) of `rank`'s tokens under the dual-chunk layout."""
    return Assignment.dualchunk(world).positions(seq_len, rank)


def shard_contiguous(x: Any, rank: int, world: int, axis: int = 1) -> Any:
    """Chunk `rank` of `world` equal chunks along `axis` (a copy)."""
    return shard_assigned(x, rank, Assignment.contiguous(world), axis)


def unshard_contiguous(shards: Sequence[Any], world: int, axis: int = 1) -> Any:
    """Inverse of `shard_contiguous`: concatenation in rank order."""
    return unshard_assigned(shards, Assignment.contiguous(world), axis)


def contiguous_positions(seq_len: int, rank: int, world: int) -> np.ndarray:
    """Global positions (int64) of `rank`'s tokens under the contiguous layout."""
    return Assignment.contiguous(world).positions(seq_len, rank)


# ---------------------------------------------------------------------------------------------
# Padding (config `parallel.pad: true`).


def padded_length(seq_len: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `seq_len`."""
    if int(multiple) < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-int(seq_len) // int(multiple)) * int(multiple)


def pad_to_multiple(x: Any, multiple: int, axis: int = 1, value: float | int = 0) -> Any:
    """`x` extended at the end of `axis` with `value` up to a multiple of `multiple`.

    Returns `x` itself when no padding is needed. Use `pad_mask` for the attention mask:
    padding it with a constant would not keep real tokens' attention unchanged.
    """
    axis = _norm_axis(x, axis)
    n = x.shape[axis]
    extra = padded_length(n, multiple) - n
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[axis] = extra
    if _is_numpy(x):
        return np.concatenate([x, np.full(shape, value, dtype=x.dtype)], axis=axis)
    import paddle

    return paddle.concat([x, paddle.full(shape, value, dtype=x.dtype)], axis=axis)


def pad_mask(indices: Any, new_len: int, *, causal: bool) -> np.ndarray:
    """A `[B, Hm, new_len, C]` mask for a sequence padded from S to `new_len` tokens.

    Guarantees, checked against `mask_indices.to_dense`:
    * real rows against real columns are masked exactly as before (so real tokens' outputs
      and gradients are unchanged);
    * padded columns (keys j >= S) are masked for every row, so padding keys are never seen;
    * the causal / non-causal form and the column count are kept.

    Thresholds >= S ("through the last row", whatever the value, as upstream FlashMask reads
    them) become `new_len`; no other value changes, and for real rows i < S the tests `i >= S`
    and `i >= new_len` agree. Padded
    columns get ranges that follow FlashMask's conventions (LTS >= j, UTE <= j + 1):
    causal `[j]` / `[j, new_len]`, non-causal `[j, j]` / `[j, new_len, 0, j]`. Padded rows
    see the real columns whose ranges ran to the end; they may be fully masked (FlashMask
    returns zeros there) and the loss must ignore them.
    """
    idx = np.asarray(as_numpy(indices))
    if idx.ndim != 4:
        raise ValueError(f"startend_row_indices must be rank 4 [B, Hm, Sk, C], got {idx.shape}")
    b, hm, s, ncol = idx.shape
    new_len = int(new_len)
    if new_len < s:
        raise ValueError(f"new_len {new_len} is shorter than the mask's sequence length {s}")
    if (causal and ncol not in (1, 2)) or (not causal and ncol not in (2, 4)):
        raise ValueError(f"a mask with {ncol} columns is not valid with causal={causal}")
    real = np.where(idx >= s, new_len, idx).astype(np.int32)
    j = np.arange(s, new_len, dtype=np.int32)
    full = np.full_like(j, new_len)
    zero = np.zeros_like(j)
    cols = {
        (True, 1): [j],
        (True, 2): [j, full],
        (False, 2): [j, j],
        (False, 4): [j, full, zero, j],
    }[(causal, ncol)]
    pad = np.broadcast_to(np.stack(cols, axis=-1), (b, hm, new_len - s, ncol))
    return np.concatenate([real, pad], axis=2).astype(np.int32)
