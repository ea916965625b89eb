"""Memory measured from Paddle's allocator: the bytes of live Paddle tensors and their peak.

On GPU the CUDA allocator's statistics (`paddle.device.cuda.memory_allocated` /
`max_memory_allocated`); on CPU the host allocator's (`core.host_memory_stat_*_value(
"Allocated", 0)`), which count exactly the bytes of Paddle tensors (numpy arrays and the
interpreter are not included — `peak_rss_bytes` is the process's whole resident peak). Every
measured peak in flashcp (metrics.jsonl, run_info.json, the memory tests) comes from here.

    with PeakMeter() as meter:
        loss = step()
    meter.peak_bytes   # the highest allocation above the start during the block
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import paddle

from flashcp.device import on_gpu

STAT = "Allocated"


def _core():  # type: ignore[no-untyped-def]
    from paddle.base import core

    return core


def allocated_bytes() -> int:
    """Bytes of Paddle tensors alive now on the current device."""
    if on_gpu():
        return int(paddle.device.cuda.memory_allocated())
    return int(_core().host_memory_stat_current_value(STAT, 0))


def peak_bytes() -> int:
    """Peak of `allocated_bytes` since the start (or the last `reset_peak`)."""
    if on_gpu():
        return int(paddle.device.cuda.max_memory_allocated())
    return int(_core().host_memory_stat_peak_value(STAT, 0))


def reset_peak() -> None:
    """Restart the peak from the current allocation."""
    if on_gpu():
        paddle.device.cuda.reset_max_memory_allocated()
    else:
        _core().host_memory_stat_reset_peak_value(STAT, 0)


def peak_rss_bytes() -> int:
    """The process's peak resident set size (everything: Python, numpy, libraries)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


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
