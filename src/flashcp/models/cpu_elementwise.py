"""RMSNorm, rotary embedding and the loss's log-softmax on CPU float32 tensors, in numpy: the
same maths, 1.5-5x faster.

Paddle's CPU element-wise kernels are 3-5x slower than numpy's at a training step's shapes
(a `[2048, 512]` RMSNorm forward + backward: 59 ms as Paddle ops, 11 ms here), so on CPU the
norms and the rotary embedding were 8-13 % of the MoE step (`docs/moe_step.md`). Each layer
here is one PyLayer whose forward and backward read the tensors' own buffers (DLPack, no
copies) and write into Paddle-allocated outputs (`flashcp.kernels.numpy_bridge.empty`, so
Paddle's allocator counts what the model keeps), with hand-derived gradients:

* RMSNorm, `y = w · x · r` with `r = 1 / sqrt(mean(x²) + eps)`:
  with `h = x · r`: `dw = Σ_tokens dy · h`, `dx = r · (g − h · mean(g · h))`, `g = dy · w`;
* rotary (a rotation of each pair of dims by its angle): the backward is the rotation by the
  opposite angle, `dx1 = dy1 · cos + dy2 · sin`, `dx2 = dy2 · cos − dy1 · sin`;
* log p(label) from logits `[rows, V]` (the loss, `models.head.token_logprobs`):
  `x[label] − max − log Σ exp(x − max)`, row block by row block so each block's max, exp and
  sum stay in cache; with a backward to come it writes the softmax `p` over the logits it
  owns (no new `[rows, V]` buffer, which Paddle's cross-entropy allocates for its softmax: a
  fresh buffer also costs its page faults) and the backward turns `p` in place into
  `dx = dlp · (onehot(label) − p)`, zero rows for ignored labels.

`models.layers` and `models.head` call these only for float32 tensors on a CPU place
(`applies`); any other dtype or device runs its Paddle ops, which GPU kernels serve. Both
paths are compared in `tests/unit/models/test_cpu_elementwise.py` under the numerics rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer

from flashcp.kernels.numpy_bridge import empty, view


def applies(*tensors: paddle.Tensor) -> bool:
    """Whether every tensor is float32 on a CPU place, in dynamic mode: the numpy path's domain."""
    return paddle.in_dynamic_mode() and all(
        t.dtype == paddle.float32 and t.place.is_cpu_place() for t in tensors
    )


def read_view(t: paddle.Tensor) -> np.ndarray:
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
        xn = read_view(x)
        r = np.float32(1.0) / np.sqrt(_row_mean(xn, xn) + np.float32(eps))
        h, hn = _out(xn)
        np.multiply(xn, r, out=hn)
        y, yn = _out(xn)
        np.multiply(hn, read_view(weight), out=yn)
        ctx.save_for_backward(h, weight)
        ctx.r = r
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)
        return y

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        h, weight = ctx.saved_tensor()
        hn, wn, dyn = read_view(h), read_view(weight), read_view(dy)
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
        return _rotate(read_view(x), read_view(cos), read_view(sin), rotary_dim, interleaved)

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> tuple[paddle.Tensor, None, None]:
        cos, sin = ctx.saved_tensor()
        return _rotate(read_view(dy), read_view(cos), -read_view(sin), *ctx.geometry), None, None


def rotary(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, *, rotary_dim: int, interleaved: bool
) -> paddle.Tensor:
    """`x` `[B, L, H, D]` with each pair of its first `rotary_dim` dims rotated by the angles
    whose cos / sin are `[B, L, 1, rotary_dim / 2]` (halves, or even/odd dims if
    `interleaved`); the other dims pass through. Gradients flow to `x` only."""
    return _Rotary.apply(x, cos, sin, rotary_dim, interleaved)


_BLOCK_ELEMENTS = 1 << 17
"""Elements per row block of the log-softmax (512 KiB of float32, 4 rows of a 32k vocabulary):
a block's max, subtraction, exp, sum and scaling run while it sits in the core's L2 cache, so
the forward crosses the memory bus once (blocks of 2-16 rows at `[2048, 32768]` measured alike
within the noise, 135-160 ms forward + backward)."""


def _check_labels(labels: np.ndarray, vocab: int, ignore_index: int) -> np.ndarray:
    """The rows whose label is not `ignore_index`, after checking every such label indexes
    the vocabulary (IndexError naming the value, as Paddle's cross-entropy raises)."""
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= vocab))
    if bad.any():
        value = int(labels[bad][0])
        raise IndexError(
            f"label value {value} is outside the vocabulary [0, {vocab}) and is not "
            f"ignore_index ({ignore_index}): fix the labels (or the model's vocab_size)"
        )
    return valid


class _LabelLogprob(PyLayer):
    """log p(label) per row of float32 logits `[..., V]`. With a backward to come, the forward
    turns the logits into their softmax in place and keeps them, and the backward turns that
    into the gradient in place: no `[rows, V]` buffer besides the logits ever exists (Paddle's
    cross-entropy allocates its softmax), and one exp per logit. The caller must own the
    logits (`label_logprobs`). Measured at `[2048, 32768]`, forward + backward, interleaved
    medians of 9: 155 ms, Paddle's cross-entropy 332 ms (`scripts/bench_moe_step.py --compare
    paddle_cross_entropy` times it in a whole step)."""

    @staticmethod
    def forward(
        ctx: Any, logits: paddle.Tensor, labels: paddle.Tensor, ignore_index: int, keep: bool
    ) -> paddle.Tensor:
        vocab = int(logits.shape[-1])
        x = (view(logits) if keep else read_view(logits)).reshape(-1, vocab)
        y = read_view(labels).reshape(-1)
        if y.shape[0] != x.shape[0]:
            raise ValueError(
                f"labels {list(labels.shape)} do not give one label per row of the logits "
                f"{list(logits.shape)}"
            )
        valid = _check_labels(y, vocab, ignore_index)
        lp, lpn = empty(tuple(int(d) for d in labels.shape), np.dtype(np.float32))
        lpn = lpn.reshape(-1)
        step = max(1, _BLOCK_ELEMENTS // vocab)
        # without a backward the logits stay as they are: one block of scratch, in cache
        scratch = None if keep else np.empty((min(step, x.shape[0]), vocab), np.float32)
        picked = x[np.arange(x.shape[0]), np.where(valid, y, 0)]  # x[label] (any, if ignored)
        for start in range(0, x.shape[0], step):
            stop = min(start + step, x.shape[0])
            xb = x[start:stop]
            pb = xb if scratch is None else scratch[: stop - start]
            m = xb.max(axis=1)
            np.subtract(xb, m[:, None], out=pb)
            np.exp(pb, out=pb)
            s = pb.sum(axis=1)
            if keep:
                pb *= (np.float32(1.0) / s)[:, None]  # the softmax, in the logits' place
            # log p(label) = (x[label] − max) − log Σ exp(x − max)
            lpn[start:stop] = (picked[start:stop] - m) - np.log(s)
        lpn[~valid] = 0.0
        if keep:
            # another op that saved these logits for its backward now fails loudly, not silently
            logits._bump_inplace_version()
            ctx.save_for_backward(logits)
            ctx.rows = (y.copy(), valid)
        return lp

    @staticmethod
    def backward(ctx: Any, dlp: paddle.Tensor) -> tuple[paddle.Tensor, None]:
        (probs,) = ctx.saved_tensor()
        y, valid = ctx.rows
        g = view(probs).reshape(-1, int(probs.shape[-1]))  # the gradient replaces the softmax
        coef = np.where(valid, -read_view(dlp).reshape(-1), np.float32(0.0))
        # dlogits = dlp · (onehot − softmax): one streaming pass, then the labels' entries
        np.multiply(g, coef[:, None], out=g)
        if not valid.all():
            g[~valid] = 0.0  # exactly zero even where an ignored row's logits were not finite
        hit = np.nonzero(valid)[0]
        g[hit, y[hit]] -= coef[hit]
        return probs, None


def label_logprobs(
    logits: paddle.Tensor, labels: paddle.Tensor, ignore_index: int
) -> paddle.Tensor:
    """log p(label) per row of float32 CPU logits `[..., V]` with int64 `labels` (the logits'
    leading shape, or it plus a trailing 1): the shape of `labels`, float32, exactly 0 with no
    gradient where `labels == ignore_index` — `-F.cross_entropy(..., reduction="none")`. A
    label outside `[0, V)` that is not `ignore_index` raises IndexError, as Paddle's does.

    With a backward to come (grad enabled, logits not stop_gradient), the logits are
    overwritten (by their softmax, then their gradient): pass logits nobody reads after this
    call (a head's fresh output); an op that saved them for its own backward then raises."""
    keep = paddle.is_grad_enabled() and not logits.stop_gradient
    if keep and not logits.is_contiguous():  # a strided view: its buffer is not the logits'
        logits = logits.contiguous()
    return _LabelLogprob.apply(logits, labels, ignore_index, keep)
