"""Which float32 slice of a pipeline stage's trainable parameters each optimizer shard owns.

Pure arithmetic (no Paddle), used by the ZeRO-1 optimizer (`flashcp.optim.master_optimizer`)
and tests.

The stage's trainable parameters, in the trainer's fixed order, are grouped into buckets of
consecutive parameters of at most `bucket_numel` float32 elements (a larger parameter gets a
bucket of its own) - the grouping the unsharded all-reduce uses (`flashcp.optim.grads`).
Each bucket's flattened gradients are padded with zeros to a multiple of N (the number of
shards) and shard s owns the bucket's elements `[s·P/N, (s+1)·P/N)` (P = padded size), so a
reduce-scatter of the bucket gives every shard exactly its own slice. A shard is the
concatenation of its slices of every bucket; inside one parameter it is one contiguous
`Segment`, or nothing. Padding is at most N - 1 elements per bucket.

Shard index of a rank (`flashcp.distributed.ParallelDims.optimizer_shard_index`):
`cp_index · dp + dp_index`, because the gradients are reduce-scattered over cp first, then dp
(the order the unsharded all-reduce sums them in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def group_buckets(sizes: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Indices of consecutive `sizes` grouped so each group holds at most `bucket_numel`
    elements; a single larger entry forms its own group."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not out or (total + n > bucket_numel and out[-1]):
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


@dataclass(frozen=True)
class Segment:
    """The part of one parameter a shard owns.

    `start`: first element inside the flattened parameter; `length`: elements; `offset`: where
    the segment starts in the shard's packed arrays (segments back to back, no padding);
    `piece_offset`: where it starts in the shard's slice of its bucket; `bucket`: bucket index.
    """

    name: str
    start: int
    length: int
    offset: int
    piece_offset: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """Consecutive parameters flattened into one buffer: names, element counts, and where each
    starts inside the buffer."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def starts(self) -> list[int]:
        out, pos = [], 0
        for n in self.sizes:
            out.append(pos)
            pos += n
        return out

    def padded(self, shards: int) -> int:
        """The buffer size after padding to a multiple of `shards`."""
        return -(-self.numel // shards) * shards


@dataclass(frozen=True)
class ShardLayout:
    """Shard `index` of `shards` over `buckets` (see the module docstring)."""

    buckets: tuple[Bucket, ...]
    shards: int
    index: int

    def __post_init__(self) -> None:
        if self.shards < 1 or not 0 <= self.index < self.shards:
            raise ValueError(f"shard index {self.index} is outside 0..{self.shards - 1}")

    def piece(self, b: int) -> int:
        """Elements of bucket `b` each shard owns (padding included)."""
        return self.buckets[b].padded(self.shards) // self.shards

    @property
    def numel(self) -> int:
        """Elements this shard owns, padding included (its reduce-scatter output)."""
        return sum(self.piece(b) for b in range(len(self.buckets)))

    def segments(self) -> list[Segment]:
        """This shard's segments, in parameter order (at most one per parameter)."""
        out: list[Segment] = []
        offset = 0
        for b, bucket in enumerate(self.buckets):
            q = self.piece(b)
            lo, hi = self.index * q, (self.index + 1) * q
            for name, size, start in zip(bucket.names, bucket.sizes, bucket.starts(), strict=True):
                a, z = max(start, lo), min(start + size, hi)
                if a < z:
                    out.append(Segment(name, a - start, z - a, offset, a - lo, b))
                    offset += z - a
        return out

    @property
    def owned(self) -> int:
        """Elements of real parameters this shard owns (padding excluded)."""
        return sum(s.length for s in self.segments())


def shard_layout(
    params: Sequence[tuple[str, int]], shards: int, index: int, bucket_numel: int
) -> ShardLayout:
    """The layout of shard `index` of `shards` over `(name, numel)` parameters (in order)."""
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    sizes = [int(n) for _, n in params]
    buckets = tuple(
        Bucket(tuple(names[i] for i in group), tuple(sizes[i] for i in group))
        for group in group_buckets(sizes, max(1, int(bucket_numel)))
    )
    return ShardLayout(buckets, int(shards), int(index))
