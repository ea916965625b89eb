"""What a call leaves allocated and how high it peaks, by Paddle's host allocator (the planner
tests' probe)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import paddle

from flashcp import masks
from flashcp.attention.context import AttentionContext


def allocated_by(call: Callable[[], Any]) -> tuple[int, int]:
    """(bytes still allocated after `call()` while its result is held, the allocator's peak
    above the start during it), measured on the second of two calls (a first one's caches
    come and go); the result is released before returning."""
    core = paddle.base.core
    kept = peak = 0
    for _ in range(2):
        gc.collect()
        start = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        result = call()
        kept = int(core.host_memory_stat_current_value("Allocated", 0) - start)
        peak = int(core.host_memory_stat_peak_value("Allocated", 0) - start)
        del result
    return kept, peak


def causal_batch(vocab_size: int, batch: int, seq: int) -> tuple[Any, Any, AttentionContext]:
    """Token ids, positions and a causal attention context for a `[batch, seq]` batch."""
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, vocab_size, (batch, seq)))
    pos = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
    return ids, pos, AttentionContext(mask=masks.causal_mask(batch, seq).indices, causal=True)


def forward_kept(model: Any, vocab_size: int, batch: int = 2, seq: int = 128) -> int:
    """Bytes still allocated after `model`'s forward on a causal `[batch, seq]` batch (its
    output included)."""
    ids, pos, ctx = causal_batch(vocab_size, batch, seq)
    return allocated_by(lambda: model(ids, pos, ctx))[0]
