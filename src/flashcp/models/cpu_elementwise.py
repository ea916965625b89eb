"""RMSNorm and rotary embedding on CPU float32 tensors, in numpy: the same maths, 3-5x faster.

Paddle's CPU element-wise kernels are 3-5x slower than numpy's at a training step's shapes
(a `[2048, 512]` RMSNorm forward + backward: 59 ms as Paddle ops, 11 ms here), so on CPU the
norms and the rotary embedding were 8-13 % of the MoE step (`docs/moe_step.md`). Each layer
here is one PyLayer whose forward and backward read the tensors' own buffers (DLPack, no
copies) and write into Paddle-allocated outputs (`flashcp.kernels.numpy_bridge.empty`, so
Paddle's allocator counts what the model keeps), with hand-derived gradients:

* RMSNorm, `y = w · x · r` with `r = 1 / sqrt(mean(x²) + eps)`:
  with `h = x · r`: `dw = Σ_tokens dy · h`, `dx = r · (g − h · mean(g · h))`, `g = dy · w`;
* rotary (a rotation of each pair of dims by its angle): the backward is the rotation by the
  opposite angle, `dx1 = dy1 · cos + dy2 · sin`, `dx2 = dy2 · cos − dy1 · sin`.

`models.layers` calls these only for float32 tensors on a CPU place (`applies`); any other
dtype or device runs its Paddle ops, which GPU kernels serve. Both paths are compared in
`tests/unit/models/test_cpu_elementwise.py` under the numerics rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer

from flashcp.kernels.numpy_bridge import empty


def applies(*tensors: paddle.Tensor) -> bool:
    """Whether every tensor is float32 on a CPU place, in dynamic mode: the numpy path's domain."""
    return paddle.in_dynamic_mode() and all(
        t.dtype == paddle.float32 and t.place.is_cpu_place() for t in tensors
    )


def view(t: paddle.Tensor) -> np.ndarray:
    """A read-only numpy view of `t`'s buffer."""
    return np.from_dlpack(t.detach())


def _out(like: np.ndarray) -> tuple[paddle.Tensor, np.ndarray]:
    """A Paddle-allocated output shaped like `like`, and its numpy view to fill."""
    return empty(like.shape, like.dtype)


def _row_mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mean(a · b) over the last axis, keeping it (float32 throughout)."""
    return (np.einsum("...i,...i->...", a, b) / np.float32(a.shape[-1]))[..., None]


class _RMSNorm(PyLayer):
    """Keeps `h = x · r` (a new buffer, never a view of the caller's `x`, which may be a slice
    of a longer tensor the saved view would keep alive) and `r`: all the backward reads."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        xn = view(x)
        r = np.float32(1.0) / np.sqrt(_row_mean(xn, xn) + np.float32(eps))
        h, hn = _out(xn)
        np.multiply(xn, r, out=hn)
        y, yn = _out(xn)
        np.multiply(hn, view(weight), out=yn)
        ctx.save_for_backward(h, weight)
        ctx.r = r
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)
        return y

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        h, weight = ctx.saved_tensor()
        hn, wn, dyn = view(h), view(weight), view(dy)
        need_x, need_w = ctx.needs  # Paddle wants None for an input that takes no gradient
        dw = None
        if need_w:
            dw, dwn = _out(wn)
            rows = (dyn.reshape(-1, dyn.shape[-1]), hn.reshape(-1, hn.shape[-1]))
            np.einsum("ti,ti->i", *rows, out=dwn)
        if not need_x:
            return None, dw
        g = dyn * wn
        dx, dxn = _out(hn)
        np.multiply(hn, _row_mean(g, hn), out=dxn)
        np.subtract(g, dxn, out=dxn)
        dxn *= ctx.r
        return dx, dw


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """`x / sqrt(mean(x²) + eps) * weight` over the last axis (float32 CPU tensors)."""
    return _RMSNorm.apply(x, weight, eps)


def _rotate(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, r: int, interleaved: bool
) -> paddle.Tensor:
    """`x` `[B, L, H, D]` with its first `r` dims turned by the angles (sin negated: backward)."""
    result, out = _out(x)
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        o1, o2 = out[..., 0:r:2], out[..., 1:r:2]
    else:
        x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
        o1, o2 = out[..., : r // 2], out[..., r // 2 : r]
    np.multiply(x1, cos, out=o1)
    o1 -= x2 * sin
    np.multiply(x2, cos, out=o2)
    o2 += x1 * sin
    out[..., r:] = x[..., r:]
    return result


class _Rotary(PyLayer):
    @staticmethod
    def forward(
        ctx: Any,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        rotary_dim: int,
        interleaved: bool,
    ) -> paddle.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.geometry = (rotary_dim, interleaved)
        return _rotate(view(x), view(cos), view(sin), rotary_dim, interleaved)

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> tuple[paddle.Tensor, None, None]:
        cos, sin = ctx.saved_tensor()
        return _rotate(view(dy), view(cos), -view(sin), *ctx.geometry), None, None


def rotary(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, *, rotary_dim: int, interleaved: bool
) -> paddle.Tensor:
    """`x` `[B, L, H, D]` with each pair of its first `rotary_dim` dims rotated by the angles
    whose cos / sin are `[B, L, 1, rotary_dim / 2]` (halves, or even/odd dims if
    `interleaved`); the other dims pass through. Gradients flow to `x` only."""
    return _Rotary.apply(x, cos, sin, rotary_dim, interleaved)
