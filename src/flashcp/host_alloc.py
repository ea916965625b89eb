"""Freed host memory kept in the process for reuse (glibc malloc), for runs that compute on CPU.

glibc serves a request above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
pages from the kernel and unmaps them on free, and a CPU training step allocates and frees
gigabytes of such buffers every step — the head's `[tokens, vocab]` logits, softmax and their
gradient, the weight gradients, the experts' buffers — so the kernel faults in and zeroes every
one of their pages again, step after step. Measured on the MoE step of
`scripts/bench_moe_step.py` (GLM-4.5-Air / 8, one thread): ~350,000 minor page faults and ~0.7 s
of system time per ~5 s step; with the memory kept, ~20,000 and under 0.1 s
(`docs/moe_step.md`). PyTorch's CPU tuning guide gives the same reason for its advice to
preload tcmalloc or jemalloc; glibc's own `mallopt` does it without another library:

* ``M_MMAP_MAX = 0``: every block comes from the heap, none from its own mapping;
* ``M_TRIM_THRESHOLD`` 2 GiB: free memory at the heap's top goes back to the kernel only
  beyond that.

The trade: the process keeps its peak heap resident (the peak RSS a run reports is unchanged;
between peaks the RSS no longer falls). Paddle's own allocator statistics, which every measured
peak in flashcp reads (`flashcp.metrics.memory`), count tensors and are unaffected. On a GPU
run the big buffers live in device memory, so this is not done there; nor outside glibc (macOS,
musl), where `retain_freed_memory` does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""glibc's `mallopt` parameters (<malloc.h>)."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free bytes at the heap's top before glibc returns them to the kernel: the largest value
`mallopt` takes (an int), 2 GiB."""

DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}
"""glibc's defaults of both (malloc(3))."""

_done: list[bool] = [False]


def _libc() -> ctypes.CDLL:
    """The C library (glibc: the caller checked)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _mallopt(values: dict[int, int]) -> bool:
    """`mallopt(param, value)` for each; False outside glibc or when one is refused."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = _libc()
    return all(libc.mallopt(param, value) == 1 for param, value in values.items())


def retain_freed_memory(*, again: bool = False) -> bool:
    """Make glibc keep freed memory for reuse (module docstring), once per process (`again`:
    even if done before, after `system_defaults`). True when it is in effect, False where
    there is no glibc `mallopt` (another C library)."""
    if _done[0] and not again:
        return True
    _done[0] = _mallopt({M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD_BYTES})
    return _done[0]


def system_defaults() -> bool:
    """glibc's defaults back for the allocations that follow (a mapping per big buffer, freed
    memory trimmed), and the memory kept so far returned (`malloc_trim`), so that what follows
    runs as in a process that never kept any: the "before" of `scripts/bench/moe_step.py`'s
    comparison."""
    ok = _mallopt(DEFAULTS)
    if ok:  # and the kept memory back to the kernel, as a process that never kept it
        _libc().malloc_trim(0)
    _done[0] = _done[0] and not ok
    return ok
