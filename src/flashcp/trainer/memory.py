"""Measured memory of Paddle tensors: the allocator's current and peak bytes.

On CPU Paddle keeps exact statistics of its host allocations
(`paddle.base.core.host_memory_stat_{current,peak}_value("Allocated", 0)`, reset with
`host_memory_stat_reset_peak_value`): every Paddle tensor's bytes, nothing else (numpy arrays
and Python objects are not counted), so a peak measured here is the tensors a computation held
at once. On GPU the same numbers come from `paddle.device.cuda.max_memory_allocated()` /
`memory_allocated()` / `reset_max_memory_allocated()`.

    with PeakMeter() as meter:
        loss = step()
    meter.peak_bytes   # the highest allocation above the start during the block
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and "gpu" in str(paddle.get_device())


def allocated_bytes() -> int:
    """Bytes of Paddle tensors allocated now on the current device."""
    if _on_gpu():
        return int(paddle.device.cuda.memory_allocated())
    return int(paddle.base.core.host_memory_stat_current_value("Allocated", 0))


def peak_bytes() -> int:
    """The allocator's peak since the last `reset_peak()` (bytes)."""
    if _on_gpu():
        return int(paddle.device.cuda.max_memory_allocated())
    return int(paddle.base.core.host_memory_stat_peak_value("Allocated", 0))


def reset_peak() -> None:
    """Start a new peak window: the peak becomes the current allocation."""
    if _on_gpu():
        paddle.device.cuda.reset_max_memory_allocated()
    else:
        paddle.base.core.host_memory_stat_reset_peak_value("Allocated", 0)


@dataclass
class PeakMeter:
    """A context manager measuring the peak tensor bytes of a block, above its start."""

    start_bytes: int = 0
    peak_bytes: int = 0
    """Highest allocation during the block minus the allocation at its start."""
    end_bytes: int = 0
    """Allocation at the end minus the allocation at the start (what the block kept)."""

    def __enter__(self) -> PeakMeter:
        reset_peak()
        self.start_bytes = allocated_bytes()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_bytes = peak_bytes() - self.start_bytes
        self.end_bytes = allocated_bytes() - self.start_bytes
