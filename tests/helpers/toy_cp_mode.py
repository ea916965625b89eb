"""The toy CP mode the registry tests add from outside `src/`: `reversed_contiguous` (rank r
holds chunk cp-1-r) run by an alias of the all-gather-KV implementation that counts its calls.
The unit test and the launched worker each register it themselves."""

from __future__ import annotations

from collections import Counter
from typing import Any

from flashcp.attention.allgather_kv import AllGatherKV
from flashcp.cp.layout import Assignment


class CountingAllGatherKV(AllGatherKV):
    """All-gather-KV under another name, counting plans and kernel passes."""

    name = "counting_allgather_kv"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def plan(self, q, k, v, ctx):  # type: ignore[no-untyped-def]
        self.calls["plan"] += 1
        return super().plan(q, k, v, ctx)

    def forward(self, q, k, v, plan):  # type: ignore[no-untyped-def]
        self.calls["forward"] += 1
        return super().forward(q, k, v, plan)

    def backward(self, q, k, v, out, lse, dout, plan):  # type: ignore[no-untyped-def]
        self.calls["backward"] += 1
        return super().backward(q, k, v, out, lse, dout, plan)


TOY_IMPL = CountingAllGatherKV()
"""The implementation the toy mode names (`implementation="helpers.toy_cp_mode:TOY_IMPL"`)."""

IMPLEMENTATION = f"{__name__}:TOY_IMPL"


def reversed_contiguous(world: int, chunks_per_rank: int, mask: Any, causal: bool) -> Assignment:
    """cp chunks, rank r holds chunk cp-1-r."""
    return Assignment.from_lists([[world - 1 - r] for r in range(world)])
