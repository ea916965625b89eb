"""Storage dtype vs compute dtype: parameters stored in bfloat16, computed in the activations'.

`train.param_dtype: bfloat16` stores parameters in bf16 (2 bytes each). Paddle 3.3.1 has no
bf16 matmul kernel on CPU, so the layers cast their weights to the activation dtype inside
`forward` (a no-op when they are equal, which is the default float32 path and the bf16 path on
GPU, where bf16 autocast decides the matmul dtype). `cast_linear` does that for the matmuls
WITHOUT keeping the float32 copy alive: a plain `F.linear(x, w.astype(...))` would save the
upcast weight for the backward pass, so every layer's float32 copy would live from its forward
to its backward — the memory bf16 storage is meant to save. `cast_linear` saves the stored
(bf16) weight and casts it again in backward, as a bf16 kernel would hold it.

Gradients of stored-bf16 weights come back in bf16 (computed in float32, cast once per
micro-batch); accumulating them in float32 (`main_grad`) is the optimizer's business.

Where flashcp promises float32 (the MoE router's affinities, the MoE combine, LoRA merges),
`float32_math` makes a matmul really float32 on a GPU too: bf16 O1 autocast casts a
white-listed matmul's inputs to bf16 whatever their dtype, and Paddle runs float32 cuBLAS
GEMMs in TF32 by default on Ampere and later (10-bit mantissa inputs, ~1e-3 relative), unlike
its CPU kernels and unlike transformers (PyTorch's float32 matmuls default to full precision).
`float32_matmul` does the same for a differentiable matmul, forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

PARAM_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""The storage dtypes `train.param_dtype` accepts."""


def as_dtype(t: paddle.Tensor | None, dtype: Any) -> paddle.Tensor | None:
    """`t` cast to `dtype` (the same tensor when it already has it; None stays None)."""
    if t is None or t.dtype == dtype:
        return t
    return t.astype(dtype)


def needs_cast(x: paddle.Tensor, *weights: paddle.Tensor | None) -> bool:
    """Whether a matmul of `x` with `weights` must upcast them here: some weight's dtype
    differs from the activation's and no autocast is active (autocast picks the kernel dtype
    itself, e.g. bf16 weights with bf16 autocast on GPU)."""
    if all(w is None or w.dtype == x.dtype for w in weights):
        return False
    return not paddle.amp.is_autocast_enabled()


class _CastLinear(PyLayer):
    """`x @ cast(w) (+ cast(b))`, saving `w` as stored (not its upcast copy) for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, transpose):  # type: ignore[no-untyped-def, override]
        ctx.transpose = transpose
        ctx.bias = None if bias is None else (bias.dtype, bias.stop_gradient)
        ctx.save_for_backward(x, weight)
        w = weight.astype(x.dtype)
        b = None if bias is None else bias.astype(x.dtype)
        if transpose:
            out = paddle.matmul(x, w, transpose_y=True)
            return out if b is None else out + b
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        x, weight = ctx.saved_tensor()
        dx = None
        if not x.stop_gradient:
            dx = paddle.matmul(grad, weight.astype(grad.dtype), transpose_y=not ctx.transpose)
        dw = None
        if not weight.stop_gradient:
            x2 = x.reshape([-1, int(x.shape[-1])])
            g2 = grad.reshape([-1, int(grad.shape[-1])])
            pair = (g2, x2) if ctx.transpose else (x2, g2)
            dw = paddle.matmul(*pair, transpose_x=True).astype(weight.dtype)
        if ctx.bias is None:
            return dx, dw
        dtype, frozen = ctx.bias
        db = None
        if not frozen:
            db = grad.reshape([-1, int(grad.shape[-1])]).sum(axis=0).astype(dtype)
        return dx, dw, db


def cast_linear(
    x: paddle.Tensor,
    weight: paddle.Tensor,
    bias: paddle.Tensor | None = None,
    *,
    transpose: bool = False,
) -> paddle.Tensor:
    """`x @ weight + bias` (`x @ weight.T` with `transpose`, e.g. a tied LM head), with
    `weight`/`bias` upcast to `x.dtype` when stored in another dtype (see the module docstring).

    Equal dtypes (or autocast) take the plain kernel, so the float32 path is unchanged bitwise.
    """
    if not needs_cast(x, weight, bias):
        if transpose:
            out = paddle.matmul(x, weight, transpose_y=True)
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)
    return _CastLinear.apply(x, weight, bias, transpose)


class Tf32Switch:
    """Paddle's switch for TF32 in float32 cuBLAS GEMMs: `paddle.base.core.set_cublas_switch` /
    `get_cublas_switch`, bound on CUDA builds only (Paddle's `pybind.cc`: to
    `phi::SetAllowTF32Cublas` / `phi::AllowTF32Cublas`; the flag defaults to true in
    `phi/backends/context_pool.cc`, and `GPUContext::CublasCall` takes its TF32 tensor-op handle
    while it is on). A CPU build (3.3.1) binds them too and reports False; `get` is None where
    they are missing."""

    def get(self) -> bool | None:
        """Whether TF32 is on (None: no switch in this build)."""
        getter = getattr(paddle.base.core, "get_cublas_switch", None)
        return None if getter is None else bool(getter())

    def set(self, on: bool) -> None:
        paddle.base.core.set_cublas_switch(bool(on))


TF32 = Tf32Switch()
"""The process's TF32 switch (tests replace it with a fake)."""


@contextmanager
def float32_math() -> Iterator[None]:
    """Matmuls inside run in float32 on every device: autocast off and TF32 off, both restored
    on exit. The switch is read by the host when a GEMM is launched, so turning it off around
    the launch is enough (the kernel may run later)."""
    with paddle.amp.auto_cast(enable=False):
        previous = TF32.get()
        if previous:
            TF32.set(False)
        try:
            yield
        finally:
            if previous:
                TF32.set(True)


class _Float32Matmul(PyLayer):
    """`x @ y` (`y` transposed with `transpose_y`) on float32 casts, under `float32_math` in
    forward and backward; saves the inputs as given; gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x, y, transpose_y):  # type: ignore[no-untyped-def, override]
        ctx.transpose_y = transpose_y
        ctx.save_for_backward(x, y)
        with float32_math():
            return paddle.matmul(as_dtype(x, "float32"), as_dtype(y, "float32"),
                                 transpose_y=transpose_y)  # fmt: skip

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        x, y = ctx.saved_tensor()
        g = as_dtype(grad, "float32")
        dx = dy = None
        with float32_math():
            if not x.stop_gradient:
                yf = as_dtype(y, "float32")
                dx = paddle.matmul(g, yf, transpose_y=not ctx.transpose_y).astype(x.dtype)
            if not y.stop_gradient:
                x2 = as_dtype(x, "float32").reshape([-1, int(x.shape[-1])])
                g2 = g.reshape([-1, int(g.shape[-1])])
                pair = (g2, x2) if ctx.transpose_y else (x2, g2)
                dy = paddle.matmul(*pair, transpose_x=True).astype(y.dtype)
        return dx, dy


def float32_matmul(
    x: paddle.Tensor, y: paddle.Tensor, *, transpose_y: bool = False
) -> paddle.Tensor:
    """`x @ y` (`x` `[..., K]`, `y` a `[K, N]` matrix, or `[N, K]` with `transpose_y`) in
    float32 on every device, forward and backward (see `float32_math`); float32 result."""
    return _Float32Matmul.apply(x, y, transpose_y)
