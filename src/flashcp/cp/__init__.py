"""Context parallelism over FlashMask, the pure pieces: layouts, balancing, rebasing, sharding.

`layout` (which global tokens each rank holds), `balance` (mask-aware chunk assignment),
`rebase` (the global mask rewritten for a rank's local query rows) and `shard` (a batch's
full sequences cut to this rank's part). The CP modes that combine a layout with an attention
implementation are registered in `flashcp.attention.registry`; the all-gather-KV attention
that runs on them is `flashcp.attention.allgather_kv`.
"""

from flashcp.cp.balance import (
    assign_chunks,
    assignment_loads,
    balanced_assignment,
    chunk_work,
    imbalance,
    rank_work,
)
from flashcp.cp.layout import (
    Assignment,
    assigned_positions,
    contiguous_positions,
    dualchunk_positions,
    pad_mask,
    pad_to_multiple,
    padded_length,
    shard_assigned,
    shard_contiguous,
    shard_dualchunk,
    unshard_assigned,
    unshard_contiguous,
    unshard_dualchunk,
)
from flashcp.cp.rebase import local_positions, rebase_mask, rebase_thresholds
from flashcp.cp.shard import LocalBatch, SequenceBatch, shard_batch

__all__ = [
    "Assignment",
    "LocalBatch",
    "SequenceBatch",
    "assign_chunks",
    "assigned_positions",
    "assignment_loads",
    "balanced_assignment",
    "chunk_work",
    "contiguous_positions",
    "dualchunk_positions",
    "imbalance",
    "local_positions",
    "pad_mask",
    "pad_to_multiple",
    "padded_length",
    "rank_work",
    "rebase_mask",
    "rebase_thresholds",
    "shard_assigned",
    "shard_batch",
    "shard_contiguous",
    "shard_dualchunk",
    "unshard_assigned",
    "unshard_contiguous",
    "unshard_dualchunk",
]
