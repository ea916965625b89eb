"""Sharding a batch for context parallelism: this rank's tokens, labels and positions.

Every recipe's batch (`flashcp.data.Batch` for pretrain / sft, `flashcp.data.dpo_packing.DPOBatch`)
holds FULL sequences `[B, S]` — labels already shifted on the whole sequence — and the global
FlashMask mask. `shard_batch` cuts this rank's part of each sequence (axis 1) under the step's
`Assignment`; the mask is not sharded: every rank keeps the global one, and attention rebases
it onto the local rows (`flashcp.cp.rebase`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from flashcp.cp.layout import Assignment, shard_assigned
from flashcp.masks import Mask


class SequenceBatch(Protocol):
    """What `shard_batch` reads: `[B, S]` arrays of full sequences and their global mask."""

    input_ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    mask: Mask


@dataclass(eq=False)
class LocalBatch:
    """One CP rank's part of a batch: its tokens/labels/positions, the global mask, and the
    layout they were cut with."""

    input_ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    mask: Mask
    assignment: Assignment


def shard_batch(batch: SequenceBatch, rank: int, assignment: Assignment) -> LocalBatch:
    """Rank `rank`'s sequence shard under `assignment` (the mask stays global)."""
    return LocalBatch(
        input_ids=shard_assigned(batch.input_ids, rank, assignment, axis=1),
        labels=shard_assigned(batch.labels, rank, assignment, axis=1),
        positions=shard_assigned(batch.positions, rank, assignment, axis=1),
        mask=batch.mask,
        assignment=assignment,
    )
