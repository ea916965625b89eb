"""The local attention implementation: the whole sequence on this rank, one FlashMask call.

`LocalAttention.plan` checks every input before any compute (`validate_attention_inputs`) and
resolves the effective FlashAttention version ONCE with `flashcp.fa_dispatch.resolve_current` (on
every device, so a bad `FLAGS_flash_attn_version` fails the same way on CPU and GPU);
`forward` / `backward` call `get_backend(plan.version, plan.device)`, and the differentiable
`apply` (`flashcp.attention.interface.AttentionFn`) hands backward the same plan, so forward
and backward always use one kernel family. On a CPU device the kernel registry maps every
version to the exact numpy reference kernel; the resolved version is still recorded.

The model reaches it through `flashcp.attention.registry.implementation_for` (no CP group of
more than one rank); `flashcp.attention.flashmask` is its public front door.
"""

from __future__ import annotations

import math
from typing import Any

import paddle

from flashcp import fa_dispatch, mask_indices
from flashcp.attention.context import AttentionContext
from flashcp.attention.interface import AttentionImpl, AttentionPlan
from flashcp.kernels import registry

CPU_DTYPES = ("float32", "float64")
ACCEL_DTYPES = ("float16", "bfloat16")


def _dtype_name(t: Any) -> str:
    return str(t.dtype).replace("paddle.", "")


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def validate_attention_inputs(
    q: Any,
    k: Any,
    v: Any,
    startend_row_indices: Any = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout: float = 0.0,
) -> str:
    """Check everything `flashmask_attention` needs; return the device string. Raises on bad input.

    NotImplementedError for dropout > 0; TypeError for non-tensors and wrong dtypes;
    ValueError for bad shapes, scale or mask (mask values via `flashcp.mask_indices.validate`).
    """
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool):
        raise TypeError(f"dropout must be a float, got {type(dropout).__name__}")
    if dropout < 0 or dropout >= 1:
        raise ValueError(f"dropout={dropout} must be in [0, 1)")
    if dropout > 0:
        raise NotImplementedError(
            f"dropout={dropout}: flashcp's FlashMask attention does not implement attention "
            "dropout (the FA3/FA4 kernels have none, and CP would need a shared RNG). "
            "Use dropout=0.0."
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, paddle.Tensor):
            raise TypeError(f"{name} must be a paddle.Tensor, got {type(t).__name__}")
        if len(t.shape) != 4:
            raise ValueError(
                f"{name} must be rank 4 [batch, seq_len, heads, head_dim] (Paddle layout), got "
                f"shape {_shape(t)}; reshape it, e.g. x.reshape([B, S, H, D])."
            )
        if any(s <= 0 for s in _shape(t)):
            raise ValueError(f"{name} has an empty axis: shape {_shape(t)}")
    (B, Sq, Hq, D), (Bk, Sk, Hkv, Dk), (Bv, Sv, Hv, _) = _shape(q), _shape(k), _shape(v)
    if not B == Bk == Bv:
        raise ValueError(
            f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (axis 0 must match)"
        )
    if Sk != Sv:
        raise ValueError(f"k and v lengths differ: k {_shape(k)}, v {_shape(v)} (axis 1)")
    if Hkv != Hv:
        raise ValueError(f"k and v head counts differ: k {_shape(k)}, v {_shape(v)} (axis 2)")
    if Hq % Hkv:
        raise ValueError(
            f"q has {Hq} heads and k/v have {Hkv}: the query heads must be a multiple of the "
            f"KV heads (GQA), shapes q {_shape(q)}, k {_shape(k)}."
        )
    if Dk != D:
        raise ValueError(
            f"q and k head_dim differ: q {_shape(q)}, k {_shape(k)} (axis 3 must match)"
        )

    devices = {name: registry.device_of(t) for name, t in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) != 1:
        raise ValueError(f"q, k, v are on different devices: {devices}; move them to one device")
    device = devices["q"]
    kind = registry.device_kind(device)
    dtypes = {name: _dtype_name(t) for name, t in (("q", q), ("k", k), ("v", v))}
    allowed = CPU_DTYPES if kind == "cpu" else ACCEL_DTYPES
    if len(set(dtypes.values())) != 1 or dtypes["q"] not in allowed:
        raise TypeError(
            f"q, k, v dtypes {dtypes} on {device}: they must share one dtype from {allowed} "
            f"({'the CPU reference kernel' if kind == 'cpu' else 'the FlashAttention kernels'})"
            "; cast with x.astype(...)."
        )

    if softmax_scale is not None:
        bad = isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
        if bad or not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(
                f"softmax_scale={softmax_scale!r} must be a positive finite float or None "
                f"(None means head_dim ** -0.5 = {D**-0.5:.6g})."
            )

    if startend_row_indices is not None:
        idx = startend_row_indices
        if not isinstance(idx, paddle.Tensor):
            raise TypeError(
                "startend_row_indices must be a paddle.Tensor (int32 [B, Hm, Sk, C]) or None, "
                f"got {type(idx).__name__}; wrap it with paddle.to_tensor(x, dtype='int32')."
            )
        if registry.device_of(idx) != device:
            raise ValueError(
                f"startend_row_indices is on {registry.device_of(idx)} but q is on {device}; "
                "move it to the same device."
            )
        mask_indices.validate(
            idx.numpy(),
            causal=causal,
            batch=B,
            q_len=Sq,
            k_len=Sk,
            num_q_heads=Hq,
            num_kv_heads=Hkv,
        )
    return device


def dispatch_call_shape(k: Any, v: Any, startend_row_indices: Any) -> dict[str, Any]:
    """The call's shape as `fa_dispatch.resolve_current` checks it against FA4's kernel limits."""
    return {
        "mask_shape": None if startend_row_indices is None else _shape(startend_row_indices),
        "num_kv_heads": int(k.shape[2]),
        "head_dim_v": int(v.shape[-1]),
    }


def plan_local(
    q: Any,
    k: Any,
    v: Any,
    startend_row_indices: Any = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout: float = 0.0,
    fa4_unavailable: str | fa_dispatch.Policy | None = None,
) -> AttentionPlan:
    """Validate the inputs and resolve the FlashAttention version: the call's plan.

    `fa4_unavailable` is the FA4-unavailable policy ("error" or "fallback"; None reads
    FLASHCP_FA4_UNAVAILABLE). Raises as `validate_attention_inputs` and
    `fa_dispatch.resolve_current` do, before any compute.
    """
    device = validate_attention_inputs(
        q, k, v, startend_row_indices, causal=causal, softmax_scale=softmax_scale, dropout=dropout
    )
    resolution = fa_dispatch.resolve_current(
        int(q.shape[-1]),
        policy=fa4_unavailable,
        **dispatch_call_shape(k, v, startend_row_indices),
    )
    registry.backend_class(resolution.version, device)  # a backend exists for it, or raise
    return AttentionPlan(resolution.version, device, startend_row_indices, causal, softmax_scale)


class LocalAttention(AttentionImpl[AttentionPlan]):
    """FlashMask attention of this rank's queries against its own keys (no CP)."""

    name = "local"

    def plan(self, q: Any, k: Any, v: Any, ctx: AttentionContext) -> AttentionPlan:
        return plan_local(
            q,
            k,
            v,
            ctx.mask_tensor(q.place),
            causal=ctx.causal,
            fa4_unavailable=ctx.fa4_unavailable,
        )

    def forward(self, q: Any, k: Any, v: Any, plan: AttentionPlan) -> tuple[Any, Any]:
        backend = registry.get_backend(plan.version, plan.device)
        return backend.forward(q, k, v, plan.mask, causal=plan.causal, softmax_scale=plan.scale)

    def backward(
        self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, plan: AttentionPlan
    ) -> tuple[Any, Any, Any]:
        backend = registry.get_backend(plan.version, plan.device)
        return backend.backward(
            q, k, v, out, lse, plan.mask, dout, causal=plan.causal, softmax_scale=plan.scale
        )


LOCAL = LocalAttention()
"""The one local implementation (stateless)."""
