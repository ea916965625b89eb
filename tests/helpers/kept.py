"""What a forward leaves for backward, by Paddle's host allocator (the planner tests' probe)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import paddle

from flashcp import masks
from flashcp.attention.context import AttentionContext


def forward_kept(model: Any, vocab_size: int, batch: int = 2, seq: int = 128) -> int:
    """Bytes still allocated after `model`'s forward on a causal `[batch, seq]` batch (its
    output included), measured on the second of two forwards (a first one's caches come
    and go)."""
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, vocab_size, (batch, seq)))
    pos = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
    ctx = AttentionContext(mask=masks.causal_mask(batch, seq).indices, causal=True)
    core = paddle.base.core
    kept = 0
    for _ in range(2):
        gc.collect()
        before = core.host_memory_stat_current_value("Allocated", 0)
        hidden = model(ids, pos, ctx)
        kept = int(core.host_memory_stat_current_value("Allocated", 0) - before)
        del hidden
    return kept
