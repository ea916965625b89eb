"""The FlashMask attention front door: validate, resolve the FA version once, run forward and
backward on that one version.

`flashmask_attention` checks every input before any compute, resolves the effective
FlashAttention version with `flashcp.dispatch.resolve_current` (on every device, so a bad
`FLAGS_flash_attn_version` fails the same way on CPU and GPU), and runs a `PyLayer` whose
forward calls `get_backend(version, device).forward` and stores the version on `ctx`. The
backward calls `get_backend(ctx.fa_version, ctx.device).backward` and never re-reads a flag,
so forward and backward always use the same kernel family (the PaddleFleet PR #1396 bug).

On a CPU device the registry maps every version to the exact numpy reference kernel; the
resolved version is still recorded and logged.

`flashmask_attention_with_version` is the same call for callers that already hold a resolved
version (context parallelism, refined recompute).
"""

from __future__ import annotations

import math
from typing import Any

import paddle
from paddle.autograd import PyLayer

from flashcp import dispatch, masks
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
    ValueError for bad shapes, scale or mask (mask values via `flashcp.masks.validate`).
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
        masks.validate(
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
    """The call's shape as `dispatch.resolve_current` checks it against FA4's kernel limits."""
    return {
        "mask_shape": None if startend_row_indices is None else _shape(startend_row_indices),
        "num_kv_heads": int(k.shape[2]),
        "head_dim_v": int(v.shape[-1]),
    }


def _grad_needed(*tensors: Any) -> bool:
    return paddle.is_grad_enabled() and any(not t.stop_gradient for t in tensors)


class FlashMaskAttentionFn(PyLayer):
    """Forward on `get_backend(fa_version, device)`; backward on the version saved in ctx.

    Inputs: q, k, v, mask (Tensor or None), then the non-tensor arguments causal,
    softmax_scale, fa_version, device. Outputs `(out, lse)`; lse is non-differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Any,
        k: Any,
        v: Any,
        startend_row_indices: Any,
        causal: bool,
        softmax_scale: float | None,
        fa_version: int,
        device: str,
    ) -> tuple[Any, Any]:
        backend = registry.get_backend(fa_version, device)
        out, lse = backend.forward(
            q, k, v, startend_row_indices, causal=causal, softmax_scale=softmax_scale
        )
        ctx.fa_version = fa_version  # the one value the backward dispatches on
        ctx.device = device
        ctx.causal = causal
        ctx.softmax_scale = softmax_scale
        ctx.has_mask = startend_row_indices is not None
        ctx.needs_grad = tuple(not t.stop_gradient for t in (q, k, v))
        saved = [q, k, v, out, lse]
        if ctx.has_mask:
            saved.append(startend_row_indices)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, *_lse_grad: Any) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensor()
        idx = rest[0] if ctx.has_mask else None
        if dout is None:
            dout = paddle.zeros_like(out)
        backend = registry.get_backend(ctx.fa_version, ctx.device)
        grads = backend.backward(
            q, k, v, out, lse, idx, dout, causal=ctx.causal, softmax_scale=ctx.softmax_scale
        )
        # Paddle wants None exactly where a forward input has stop_gradient=True.
        result = [g if need else None for g, need in zip(grads, ctx.needs_grad, strict=True)]
        if ctx.has_mask:
            result.append(None)  # the int32 mask takes no gradient
        return tuple(result)


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
    if _grad_needed(q, k, v):
        out, lse = FlashMaskAttentionFn.apply(
            q, k, v, startend_row_indices, causal, softmax_scale, fa_version, device
        )
    else:
        out, lse = registry.get_backend(fa_version, device).forward(
            q, k, v, startend_row_indices, causal=causal, softmax_scale=softmax_scale
        )
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
    fa4_unavailable: str | None = None,
) -> Any:
    """FlashMask attention `softmax(q kᵀ * scale + M) v` with a column-wise mask M.

    q `[B, Sq, Hq, D]`, k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]` (Hq a multiple of Hkv);
    float32/float64 on CPU, float16/bfloat16 on GPU. `startend_row_indices` is the int32
    FlashMask mask `[B, Hm, Sk, C]` (see `flashcp.masks`) or None; `causal` is bottom-right
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
    validate_attention_inputs(
        q, k, v, startend_row_indices, causal=causal, softmax_scale=softmax_scale, dropout=dropout
    )
    resolution = dispatch.resolve_current(
        int(q.shape[-1]),
        policy=fa4_unavailable,
        **dispatch_call_shape(k, v, startend_row_indices),
    )
    return flashmask_attention_with_version(
        q,
        k,
        v,
        startend_row_indices,
        fa_version=resolution.version,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        validate=False,
    )
