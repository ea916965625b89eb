"""The attention-backend contract every kernel family implements (CPU reference, FA2, FA3, FA4).

A backend is a stateless object. The context-parallel layer and the front door
(`flashcp.attention`) call it with a FlashAttention version resolved *once*, through
`flashcp.kernels.registry.get_backend(version, device)`, so forward and backward always run the
same family.

Layout (Paddle's): q `[B, Sq, Hq, D]`, k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]`, with
`Hq % Hkv == 0` (GQA / MQA). `startend_row_indices` is the FlashMask column mask
`[B, Hm, Sk, C]` int32 with `Hm in {1, Hkv, Hq}` (see `flashcp.masks`), or None for "no mask"
(the `causal` flag still applies). Results: out `[B, Sq, Hq, Dv]` in q's dtype and lse
`[B, Hq, Sq]` (natural log, float32). Gradients: dq like q, dk/dv like k/v, with dk/dv summed
over the query heads of each KV group.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

Tensor = Any  # paddle.Tensor; kept loose so importing this module never imports paddle


@runtime_checkable
class AttentionBackend(Protocol):
    """What `registry.get_backend` returns. Keep this API stable: the CP layer depends on it."""

    name: str

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        startend_row_indices: Tensor | None,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        """Return `(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`."""
        ...

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        startend_row_indices: Tensor | None,
        dout: Tensor,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return `(dq, dk, dv)` for the forward that produced `out` and `lse`."""
        ...


def default_scale(head_dim: int) -> float:
    """FlashAttention's default softmax scale, `head_dim ** -0.5`."""
    return float(head_dim) ** -0.5


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """`softmax_scale`, or the default `head_dim ** -0.5` when it is None."""
    return default_scale(head_dim) if softmax_scale is None else float(softmax_scale)


def is_default_scale(softmax_scale: float | None, head_dim: int) -> bool:
    """Whether `softmax_scale` is None or equal (to float rounding) to the default."""
    if softmax_scale is None:
        return True
    return math.isclose(float(softmax_scale), default_scale(head_dim), rel_tol=1e-6)
