"""Batch sharding for CP (`flashcp.cp.shard`): every mode's shards reassemble the batch, with
global positions."""

from __future__ import annotations

import numpy as np
import pytest

from flashcp.attention import registry as cp_modes
from flashcp.attention.registry import make_assignment
from flashcp.config import IGNORE_INDEX
from flashcp.cp.layout import Assignment, unshard_assigned
from flashcp.cp.shard import shard_batch
from flashcp.data import PackedStream, collate
from helpers.batches import marked_documents


@pytest.mark.parametrize("mode", cp_modes.names())
def test_shards_reassemble_with_global_positions(mode: str) -> None:
    stream = PackedStream(marked_documents([9, 40, 3, 17, 25, 6]), 32, seed=0)
    batch = collate([stream.next(), stream.next()])
    world = 2
    asg: Assignment = make_assignment(mode, world, batch.mask.indices, causal=True)
    parts = [shard_batch(batch, r, asg) for r in range(world)]
    for name in ("input_ids", "labels", "positions"):
        whole = unshard_assigned([getattr(p, name) for p in parts], asg, axis=1)
        np.testing.assert_array_equal(whole, getattr(batch, name))
    for r, part in enumerate(parts):
        assert part.positions[0].tolist() == asg.positions(32, r).tolist()
        assert part.mask is batch.mask
    assert sum(int((p.labels != IGNORE_INDEX).sum()) for p in parts) == batch.num_targets
