"""The FlashMask attention front door: `flashmask_attention` on this rank's whole sequence.

The public face of `flashcp.attention.local`: `flashmask_attention` plans the call
(`plan_local`: every input checked before any compute, the effective FlashAttention version
resolved once with `flashcp.fa_dispatch.resolve_current`) and runs it through `LOCAL.apply`, whose
one PyLayer (`flashcp.attention.interface.AttentionFn`) runs backward on the version forward
used — never re-reading a flag (the PaddleFleet PR #1396 bug).

`flashmask_attention_with_version` is the same call for callers that already hold a resolved
version (benchmarks, tests of one backend).
"""

from __future__ import annotations

from typing import Any

from flashcp.attention.interface import AttentionPlan
from flashcp.attention.local import LOCAL, plan_local, validate_attention_inputs
from flashcp.fa_dispatch import Policy
from flashcp.kernels import registry


def flashmask_attention_with_version(
    q: Any,
    k: Any,
    v: Any,
    startend_row_indices: Any = None,
    *,
    fa_version: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> Any:
    """FlashMask attention on an already-resolved FlashAttention version.

    Same arguments and results as `flashmask_attention`, minus the resolution: `fa_version`
    (2, 3 or 4) picks the backend for both forward and backward via
    `flashcp.kernels.registry.get_backend(fa_version, device)`. `validate=False` skips the
    input checks (for callers that ran `validate_attention_inputs` already).
    """
    if validate:
        device = validate_attention_inputs(
            q, k, v, startend_row_indices, causal=causal, softmax_scale=softmax_scale
        )
    else:
        device = registry.device_of(q)
    registry.backend_class(fa_version, device)  # reject a bad version before any compute
    plan = AttentionPlan(fa_version, device, startend_row_indices, causal, softmax_scale)
    out, lse = LOCAL.apply_with_lse(q, k, v, plan)
    return (out, lse) if return_lse else out


def flashmask_attention(
    q: Any,
    k: Any,
    v: Any,
    startend_row_indices: Any = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    dropout: float = 0.0,
    fa4_unavailable: str | Policy | None = None,
) -> Any:
    """FlashMask attention `softmax(q kᵀ * scale + M) v` with a column-wise mask M.

    q `[B, Sq, Hq, D]`, k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]` (Hq a multiple of Hkv);
    float32/float64 on CPU, float16/bfloat16 on GPU. `startend_row_indices` is the int32
    FlashMask mask `[B, Hm, Sk, C]` (see `flashcp.mask_indices`) or None; `causal` is bottom-right
    aligned when Sq != Sk. `softmax_scale` defaults to `D ** -0.5`. `dropout` must be 0.
    `fa4_unavailable` is the FA4-unavailable policy ("error" or "fallback"; None reads
    FLASHCP_FA4_UNAVAILABLE, default "error").

    Returns out `[B, Sq, Hq, Dv]`, or `(out, lse)` with lse `[B, Hq, Sq]` (natural log,
    non-differentiable; float32, or float64 for float64 CPU inputs) when `return_lse`. Fully
    masked rows give out 0; their LSE is -inf on CPU (+inf from Paddle's CUDA kernels).
    Raises `FlashAttnUnavailableError` under the "error" policy, on every device, when the
    requested FA4 has no backend or this call is beyond its kernel's limits (mask columns and
    heads, head dims), or when an effective FA3 meets a card that is not SM90.
    """
    plan = plan_local(
        q,
        k,
        v,
        startend_row_indices,
        causal=causal,
        softmax_scale=softmax_scale,
        dropout=dropout,
        fa4_unavailable=fa4_unavailable,
    )
    out, lse = LOCAL.apply_with_lse(q, k, v, plan)
    return (out, lse) if return_lse else out
