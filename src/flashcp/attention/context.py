"""`AttentionContext`: what every attention layer of one forward pass shares, and its plans.

Beyond the activations a layer needs the GLOBAL FlashMask mask (every CP rank keeps all of it),
its `causal` flag, and the CP group, mode and layout. `flashcp.attention.registry` reads the
context to pick the implementation (local unless a CP group of more than one rank is given);
`AttentionContext.plan` plans each call shape once: every layer of a micro-batch, and its
activation recompute, runs on one plan — one validation, one FlashAttention version, one
rebased local mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from flashcp.attention.interface import AttentionImpl, PlanT
from flashcp.attention.registry import DEFAULT_MODE
from flashcp.fa_dispatch import Policy
from flashcp.mask_indices import as_numpy


def _call_key(t: paddle.Tensor) -> tuple[Any, ...]:
    return tuple(int(s) for s in t.shape), str(t.dtype), str(t.place)


@dataclass
class AttentionContext:
    """Per-step attention inputs shared by all layers.

    `mask` is the GLOBAL `startend_row_indices` (int32 `[B, Hm, S, C]`, numpy or paddle) or
    None (then `causal` alone decides; CP needs a mask). `group` is the CP process group (None
    or one rank: no CP), `mode` its CP mode (`flashcp.attention.registry`), `assignment` its
    chunk layout (None: derived from `mode`). `query_chunk` / `kv_chunk` > 0 run the mode's
    chunked implementation (`attention.*` of the config).
    """

    mask: Any
    causal: bool
    group: Any = None
    assignment: Any = None
    mode: str = DEFAULT_MODE
    fa4_unavailable: str | Policy | None = None
    query_chunk: int = 0
    """`attention.query_chunk`: local query rows per kernel call (0: all of them)."""
    kv_chunk: int = 0
    """`attention.kv_chunk`: global keys gathered at once (0: all of them)."""
    _tensor_cache: dict[str, paddle.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _plans: dict[tuple[Any, ...], Any] = field(  # (impl, call shapes) → that impl's plan
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def uses_cp(self) -> bool:
        """Whether attention is context-parallel (a group of more than one rank)."""
        return self.group is not None and int(self.group.nranks) > 1

    @property
    def chunked(self) -> bool:
        """Whether attention runs in chunks (`flashcp.attention.allgather_kv_chunked`)."""
        return self.query_chunk > 0 or self.kv_chunk > 0

    def mask_tensor(self, place: Any) -> paddle.Tensor | None:
        """The mask as a paddle int32 tensor on `place`, converted once per context."""
        if self.mask is None:
            return None
        if isinstance(self.mask, paddle.Tensor) and str(self.mask.place) == str(place):
            return self.mask
        key = str(place)
        if key not in self._tensor_cache:
            arr = np.ascontiguousarray(as_numpy(self.mask))
            self._tensor_cache[key] = paddle.to_tensor(arr, place=place)
        return self._tensor_cache[key]

    def plan(self, impl: AttentionImpl[PlanT], q: Any, k: Any, v: Any) -> PlanT:
        """`impl.plan(q, k, v, self)`, built once per implementation and call shape.

        Every layer of the model calls attention with the same shapes, dtypes and place, so
        one plan serves them all (and the recompute replays); the flags are read once per
        context, which is once per micro-batch.
        """
        key = (impl, *(_call_key(t) for t in (q, k, v)))
        if key not in self._plans:
            self._plans[key] = impl.plan(q, k, v, self)
        return self._plans[key]
