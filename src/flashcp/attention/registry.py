"""THE registry of context-parallel modes: name → chunks per rank, layout, implementation.

A CP mode (`parallel.cp_mode`, `AttentionContext.mode`) is one `CPMode` entry here and
nothing else:

* `chunks_per_rank`: how many chunks of the sequence each rank holds, so `data.seq_len` must
  divide by cp × this (`flashcp.config` checks it, `flashcp.plan` pads by it);
* `layout(world, chunks_per_rank, mask, causal) -> Assignment`: which chunks each rank holds
  for a micro-batch (`flashcp.cp.layout`), fixed per mode or computed from the batch's
  global mask (`workload_balanced`, `flashcp.cp.balance`);
* `implementation`: the `AttentionImpl` that runs on that layout, named as
  "module:attribute" and imported the first time attention asks for it;
* `chunked`: the implementation that runs on that layout when attention is chunked
  (`attention.query_chunk` / `attention.kv_chunk`, carried by `AttentionContext`).

Chunking is an option of a mode's algorithm, not a mode of its own: the chunk sizes are
numbers, orthogonal to the layout (every layout runs chunked the same way), so making them
modes would multiply the table (dualchunk × chunked, contiguous × chunked, ...) and still need
the numbers from the config. The table stays the one place that says what runs: each entry
names both implementations, and `implementation_for(ctx)` picks between them.

Everyone reads this table: the config loader and validator (the accepted names, the
divisibility rule), the memory planner, the trainer (`make_assignment` per micro-batch) and
the model (`implementation_for(ctx)`). Adding a mode is `register(CPMode(...))` here plus its
implementation's file when it brings a new algorithm (docs/architecture.md walks through it).

This module imports neither paddle nor an implementation — only `flashcp.cp` (numpy) — so
the config layer (which the launcher imports before any rank runs) stays free of paddle;
`implementation` imports an implementation's module when attention first runs it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashcp.cp.balance import balanced_assignment
from flashcp.cp.layout import Assignment

if TYPE_CHECKING:  # paddle: only under a type checker (see the module docstring)
    from flashcp.attention.context import AttentionContext
    from flashcp.attention.interface import AttentionImpl

Layout = Callable[[int, int, Any, bool], Assignment]
"""`(world, chunks_per_rank, global mask [B, Hm, S, C] or None, causal) -> Assignment`."""

LOCAL = "flashcp.attention.local:LOCAL"
"""The implementation without CP (the whole sequence on this rank)."""
ALLGATHER_KV = "flashcp.attention.allgather_kv:ALLGATHER_KV"
"""All-gather-KV CP attention: one FlashMask call of the local queries against all keys."""
ALLGATHER_KV_CHUNKED = "flashcp.attention.allgather_kv_chunked:ALLGATHER_KV_CHUNKED"
"""The same attention in chunks of local queries and of gathered global keys, LSE-merged."""


@dataclass(frozen=True)
class CPMode:
    """One context-parallel mode: its layout over the cp ranks and the attention run on it."""

    name: str
    """The value of `parallel.cp_mode` / `AttentionContext.mode`."""
    chunks_per_rank: int
    """Chunks of the sequence each rank holds: data.seq_len must divide by cp × this."""
    layout: Layout
    """Builds a micro-batch's `Assignment` (see `Layout`)."""
    implementation: str = ALLGATHER_KV
    """The `AttentionImpl` as "module:attribute", imported on first use."""
    summary: str = ""
    """One line for docs and messages."""
    chunked: str | None = None
    """The `AttentionImpl` ("module:attribute") run on this layout when attention is chunked
    (`attention.query_chunk` / `attention.kv_chunk` > 0); None: the all-gather-KV chunked
    implementation when `implementation` is all-gather KV, else the mode cannot chunk."""

    @property
    def chunked_implementation(self) -> str | None:
        """What runs under chunking: `chunked`, or its default (see `chunked`)."""
        if self.chunked is not None:
            return self.chunked
        return ALLGATHER_KV_CHUNKED if self.implementation == ALLGATHER_KV else None


MODES: dict[str, CPMode] = {}
"""Every known CP mode by name, in registration order."""


def register(mode: CPMode) -> CPMode:
    """Make `mode` a valid `parallel.cp_mode` (and `AttentionContext.mode`)."""
    if mode.chunks_per_rank < 1:
        raise ValueError(f"cp mode {mode.name!r}: chunks_per_rank must be >= 1")
    MODES[mode.name] = mode
    return mode


def names() -> tuple[str, ...]:
    """The registered mode names, in registration order."""
    return tuple(MODES)


def get(name: str) -> CPMode:
    """The mode called `name`; ValueError listing the modes otherwise."""
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"cp mode {name!r} is not supported: use one of {', '.join(MODES)}")
    return mode


def make_assignment(name: str, world: int, mask: Any = None, *, causal: bool = False) -> Assignment:
    """The chunk layout of mode `name` over `world` ranks for a batch with global `mask`."""
    mode = get(name)
    assignment = mode.layout(world, mode.chunks_per_rank, mask, causal)
    if assignment.world != world or assignment.chunks_per_rank != mode.chunks_per_rank:
        raise ValueError(
            f"cp mode {name!r}: its layout gave {assignment.world} ranks × "
            f"{assignment.chunks_per_rank} chunks, the registry says {world} × "
            f"{mode.chunks_per_rank}"
        )
    return assignment


def implementation(name: str) -> AttentionImpl[Any]:
    """The attention implementation of mode `name`."""
    return _load(get(name).implementation)


def chunked_implementation(name: str) -> AttentionImpl[Any]:
    """The chunked attention implementation of mode `name`; ValueError when it has none."""
    path = get(name).chunked_implementation
    if path is None:
        raise ValueError(
            f"cp mode {name!r} has no chunked attention: set attention.query_chunk and "
            "attention.kv_chunk to 0, or use a mode that has one"
        )
    return _load(path)


def implementation_for(ctx: AttentionContext) -> AttentionImpl[Any]:
    """What the model runs for `ctx`: the mode's chunked implementation when the context asks
    for chunks (with or without CP); else local without a CP group of more than one rank, and
    the implementation of `ctx.mode` with one."""
    if ctx.chunked:
        return chunked_implementation(ctx.mode)
    return implementation(ctx.mode) if ctx.uses_cp else _load(LOCAL)


@functools.cache
def _load(path: str) -> AttentionImpl[Any]:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


# ------------------------------------------------------------------------------- the modes


def _dualchunk(world: int, chunks_per_rank: int, mask: Any, causal: bool) -> Assignment:
    return Assignment.dualchunk(world)


def _contiguous(world: int, chunks_per_rank: int, mask: Any, causal: bool) -> Assignment:
    return Assignment.contiguous(world)


def _balanced(world: int, chunks_per_rank: int, mask: Any, causal: bool) -> Assignment:
    if mask is None:
        raise ValueError("mode='workload_balanced' needs the global mask to balance work")
    return balanced_assignment(mask, causal=causal, world=world, chunks_per_rank=chunks_per_rank)


register(
    CPMode(
        "dualchunk_allgather",
        2,
        _dualchunk,
        summary="rank r holds chunks r and 2cp-1-r of 2cp: balanced causal work",
    )
)
register(CPMode("contiguous_allgather", 1, _contiguous, summary="rank r holds chunk r of cp"))
register(
    CPMode(
        "workload_balanced",
        4,  # measured in docs/cp_balance.md: 4 chunks per rank reach max/mean <= 1.05
        _balanced,
        summary="chunks assigned per batch from the mask's work",
    )
)

DEFAULT_MODE = "dualchunk_allgather"
"""The mode of `parallel.cp_mode` and `AttentionContext` when none is given."""
