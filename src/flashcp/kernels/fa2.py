"""FA2 backend: Paddle's FlashAttention-2 ops, called with their exact positional layouts.

With a mask: `_C_ops.flashmask_attention` / `flashmask_attention_grad`; without one:
`_C_ops.flash_attn` / `flash_attn_grad` (reference §1.6). The ops run in training mode with
dropout 0.0.

FA2 has no softmax-scale argument in its grad ops (Paddle's own `flashmask_attention` asserts
`softmax_scale is None` for FA2), so a non-default `softmax_scale` raises NotImplementedError
here rather than silently using `head_dim ** -0.5`.

Paddle's FA2 ops read `FLAGS_flash_attn_version` internally, so every op call runs with the
flag held at 2 (`flash_attn_version_flag`), whatever the user set it to.

The forward's `seed_offset` output is not part of the backend contract; with dropout 0.0 its
value does not matter, so the backward passes a dummy `[2]` int64 host tensor (the grad
kernels read two int64 values from host memory).
"""

from __future__ import annotations

from typing import Any

from flashcp.kernels.base import flash_attn_version_flag, is_default_scale

DROPOUT = 0.0


def _c_ops() -> Any:
    from paddle import _C_ops

    return _C_ops


def _dummy_seed_offset() -> Any:
    import paddle

    return paddle.zeros([2], dtype="int64").cpu()


def check_scale(softmax_scale: float | None, head_dim: int) -> None:
    """Refuse a custom softmax scale, which the FA2 ops cannot apply."""
    if not is_default_scale(softmax_scale, head_dim):
        raise NotImplementedError(
            f"FA2 (fa_version=2) cannot use softmax_scale={softmax_scale}: its kernels always "
            f"scale by head_dim ** -0.5 = {head_dim**-0.5:.6g}. Leave softmax_scale unset, "
            "or pre-scale q by softmax_scale * sqrt(head_dim), or use FA3."
        )


class FA2Backend:
    """Paddle FlashAttention-2 / FlashMask-v1 CUDA (and XPU) ops."""

    name = "fa2"
    version = 2

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
        check_scale(softmax_scale, int(q.shape[-1]))
        ops = _c_ops()
        with flash_attn_version_flag(self.version):  # the op reads the flag: it must say 2
            if startend_row_indices is None:
                out, _softmax, lse, _seed_offset = ops.flash_attn(
                    q, k, v, None, None, DROPOUT, causal, False, False, ""
                )
            else:
                out, _softmax, lse, _seed_offset = ops.flashmask_attention(
                    q, k, v, startend_row_indices, None, DROPOUT, causal, False, False, ""
                )
        return out, lse

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
        check_scale(softmax_scale, int(q.shape[-1]))
        ops = _c_ops()
        seed_offset = _dummy_seed_offset()
        with flash_attn_version_flag(self.version):
            if startend_row_indices is None:
                dq, dk, dv = ops.flash_attn_grad(
                    q, k, v, out, lse, seed_offset, None, dout, DROPOUT, causal
                )
            else:
                dq, dk, dv = ops.flashmask_attention_grad(
                    q, k, v, startend_row_indices, out, lse, seed_offset, dout, DROPOUT, causal
                )
        return dq, dk, dv
