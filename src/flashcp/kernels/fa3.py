"""FA3 backend: Paddle's FlashAttention-3 ops (`flashmask_attention_v2`, `flash_attn_v3`).

`_C_ops.flashmask_attention_v2(_grad)` has three positional layouts depending on the Paddle
build (reference §1.6). The layout is chosen by probing the parameters of the Python API
`paddle.nn.functional.flashmask_attention`:

* "group" present (newest): forward `(q, k, v, startend, None block_mask, None nvshmem_id,
  scale, causal, 0 rank, 1 nranks)`; grad `(q, k, v, out, lse, startend, None block_mask,
  dout, scale, causal, 0, 1)`;
* "block_mask" present: forward `(q, k, v, startend, None, scale, causal)`; grad
  `(q, k, v, out, lse, startend, None, dout, scale, causal)`;
* neither (legacy): forward `(q, k, v, startend, scale, causal)`; grad
  `(q, k, v, out, lse, startend, dout, scale, causal)`.

Without a mask the plain FA3 ops run: `flash_attn_v3(q, k, v, None x4, scale, causal, -1, -1,
0.0, 1, False, False, 0)` and `flash_attn_v3_grad(q, k, v, out, lse, dout, scale, causal, -1,
-1, 0.0, 0)`. The scale is always passed as a Python float (default `head_dim ** -0.5`).
"""

from __future__ import annotations

import inspect
from typing import Any

from flashcp.kernels.base import flash_attn_version_flag, resolve_scale

VARIANT_GROUP = "group"
VARIANT_BLOCK_MASK = "block_mask"
VARIANT_LEGACY = "legacy"

# flash_attn_v3 trailing arguments: window left/right, softcap, num_splits, manual pack-GQA,
# pack-GQA, sm_margin; the grad takes window left/right, softcap, sm_margin.
_NO_WINDOW = (-1, -1)
_SOFTCAP = 0.0
_NUM_SPLITS = 1
_SM_MARGIN = 0


def _c_ops() -> Any:
    from paddle import _C_ops

    return _C_ops


def flashmask_v2_variant() -> str:
    """Which `flashmask_attention_v2` layout this Paddle has: "group", "block_mask" or "legacy"."""
    import paddle.nn.functional as F

    params = inspect.signature(F.flashmask_attention).parameters
    if "group" in params:
        return VARIANT_GROUP
    if "block_mask" in params:
        return VARIANT_BLOCK_MASK
    return VARIANT_LEGACY


class FA3Backend:
    """Paddle FlashAttention-3 / FlashMask-v2 CUDA ops (Hopper)."""

    name = "fa3"
    version = 3

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        startend_row_indices: Any,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Any, Any]:
        with flash_attn_version_flag(self.version):  # hold the flag at 3 around the op
            return _forward(q, k, v, startend_row_indices, causal, softmax_scale)

    def backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        startend_row_indices: Any,
        dout: Any,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Any, Any, Any]:
        with flash_attn_version_flag(self.version):
            return _backward(q, k, v, out, lse, startend_row_indices, dout, causal, softmax_scale)


def _forward(
    q: Any, k: Any, v: Any, startend_row_indices: Any, causal: bool, softmax_scale: float | None
) -> tuple[Any, Any]:
    scale = resolve_scale(softmax_scale, int(q.shape[-1]))
    ops = _c_ops()
    if startend_row_indices is None:
        out, lse = ops.flash_attn_v3(
            q, k, v, None, None, None, None, scale, causal,
            *_NO_WINDOW, _SOFTCAP, _NUM_SPLITS, False, False, _SM_MARGIN,
        )  # fmt: skip
        return out, lse
    idx = startend_row_indices
    variant = flashmask_v2_variant()
    if variant == VARIANT_GROUP:
        out, lse = ops.flashmask_attention_v2(q, k, v, idx, None, None, scale, causal, 0, 1)
    elif variant == VARIANT_BLOCK_MASK:
        out, lse = ops.flashmask_attention_v2(q, k, v, idx, None, scale, causal)
    else:
        out, lse = ops.flashmask_attention_v2(q, k, v, idx, scale, causal)
    return out, lse


def _backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    startend_row_indices: Any,
    dout: Any,
    causal: bool,
    softmax_scale: float | None,
) -> tuple[Any, Any, Any]:
    scale = resolve_scale(softmax_scale, int(q.shape[-1]))
    ops = _c_ops()
    if startend_row_indices is None:
        dq, dk, dv = ops.flash_attn_v3_grad(
            q, k, v, out, lse, dout, scale, causal, *_NO_WINDOW, _SOFTCAP, _SM_MARGIN
        )
        return dq, dk, dv
    idx = startend_row_indices
    variant = flashmask_v2_variant()
    grad = ops.flashmask_attention_v2_grad
    if variant == VARIANT_GROUP:
        dq, dk, dv = grad(q, k, v, out, lse, idx, None, dout, scale, causal, 0, 1)
    elif variant == VARIANT_BLOCK_MASK:
        dq, dk, dv = grad(q, k, v, out, lse, idx, None, dout, scale, causal)
    else:
        dq, dk, dv = grad(q, k, v, out, lse, idx, dout, scale, causal)
    return dq, dk, dv
