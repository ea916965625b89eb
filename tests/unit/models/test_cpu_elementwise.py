"""The numpy RMSNorm and rotary (`flashcp.models.cpu_elementwise`) against float64 references.

Outputs and gradients (x and the norm's weight) of the numpy path are compared with a float64
autograd computation of the same formula under the rule of `bench.numerics`, and so is the
Paddle-op path the same layers take off CPU / float32 (forced here by a float64 run, which is
then cast): both paths compute the one function. Negative controls: a gradient of the wrong
formula (the norm's `r` not differentiated; the rotary's backward turned the forward way) is
rejected by the same comparison.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.models import cpu_elementwise
from flashcp.models.layers import RMSNorm, apply_rotary, rotary_tables
from flashcp.models.rope import inverse_frequencies

RNG = np.random.default_rng(11)


def _grads(fn, inputs: list[np.ndarray], dy: np.ndarray, dtype: str) -> list[np.ndarray]:
    """fn's output and the gradients of <fn(inputs), dy> w.r.t. every input, in `dtype`."""
    ts = [paddle.to_tensor(a.astype(dtype), stop_gradient=False) for a in inputs]
    y = fn(*ts)
    y.backward(paddle.to_tensor(dy.astype(dtype)))
    return [y.numpy().astype(np.float64)] + [t.grad.numpy().astype(np.float64) for t in ts]


def _norm_ref(x: paddle.Tensor, w: paddle.Tensor, eps: float = 1e-5) -> paddle.Tensor:
    return w * (x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps))


@pytest.mark.parametrize(("shape", "scale"), [((2, 37, 64), 3.0), ((300, 128), 3.0),
                                             ((4, 16), 1e-3)])  # fmt: skip
def test_rms_norm_matches_float64_autograd(shape: tuple[int, ...], scale: float) -> None:
    """(At scale 1e-3, mean(x²) is below eps: eps's place in the formula shows.)"""
    hidden = shape[-1]
    x = RNG.standard_normal(shape) * scale
    w = RNG.uniform(0.5, 1.5, hidden)
    dy = RNG.standard_normal(shape)
    want = _grads(_norm_ref, [x, w], dy, "float64")

    def numpy_path(xt: paddle.Tensor, wt: paddle.Tensor) -> paddle.Tensor:
        assert cpu_elementwise.applies(xt, wt)
        return cpu_elementwise.rms_norm(xt, wt, 1e-5)

    norm = RMSNorm(hidden, eps=1e-5)  # the model's own layer, float32 on CPU: the numpy path
    norm.weight.set_value(w.astype(np.float32))
    xt = paddle.to_tensor(x.astype(np.float32), stop_gradient=False)
    y = norm(xt)
    y.backward(paddle.to_tensor(dy.astype(np.float32)))
    layer = [t.numpy().astype(np.float64) for t in (y, xt.grad, norm.weight.grad)]

    tokens = x.size // hidden
    for got in (_grads(numpy_path, [x, w], dy, "float32"), layer):
        numerics.assert_close(got[0], want[0], n=hidden, what="y")
        numerics.assert_close(got[1], want[1], n=hidden, norm="l2", what="dx")
        numerics.assert_close(got[2], want[2], n=tokens, norm="l2", what="dw")
    # Negative control: dx without r's own derivative (g · r, the 'detached r' mistake).
    g = dy * w
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    numerics.assert_rejects(g * r, want[1], n=hidden, norm="l2")


def test_rms_norm_paddle_path_serves_other_dtypes() -> None:
    """float64 (and any non-float32 or non-CPU tensor) takes the Paddle ops, not numpy."""
    x = paddle.to_tensor(RNG.standard_normal((4, 8)))
    w = paddle.ones([8], dtype="float64")
    assert not cpu_elementwise.applies(x, w)
    assert cpu_elementwise.applies(x.astype("float32"), w.astype("float32"))
    assert not cpu_elementwise.applies(x.astype("float32"), w)


def _rotary_ref(x: np.ndarray, pos: np.ndarray, inv: np.ndarray, interleaved: bool) -> np.ndarray:
    """float64 rotation of each pair by pos · f_i, written independently of both paths."""
    r = 2 * len(inv)
    ang = pos[:, :, None, None] * inv  # [B, L, 1, r/2]
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    i1 = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    i2 = i1 + 1 if interleaved else i1 + r // 2
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


@pytest.mark.parametrize(("interleaved", "rotary_dim"), [(False, 16), (True, 16), (False, 8)])
def test_rotary_matches_a_float64_rotation(interleaved: bool, rotary_dim: int) -> None:
    B, L, H, D = 2, 9, 3, 16
    x = RNG.standard_normal((B, L, H, D))
    dy = RNG.standard_normal((B, L, H, D))
    pos = np.stack([np.arange(L) + 5, np.arange(L) * 3]).astype(np.int64)
    inv = inverse_frequencies(rotary_dim, 10000.0)
    want_y = _rotary_ref(x, pos.astype(np.float64), inv.astype(np.float64), interleaved)
    # The rotation is orthogonal: its gradient is the inverse rotation of dy (angle negated).
    want_dx = _rotary_ref(dy, -pos.astype(np.float64), inv.astype(np.float64), interleaved)
    tables = rotary_tables(paddle.to_tensor(pos), inv, interleaved=interleaved)

    def run(x32: np.ndarray) -> list[np.ndarray]:
        xt = paddle.to_tensor(x32, stop_gradient=False)
        y = apply_rotary(xt, tables)
        y.backward(paddle.to_tensor(dy.astype(np.float32)))
        return [y.numpy().astype(np.float64), xt.grad.numpy().astype(np.float64)]

    assert cpu_elementwise.applies(paddle.to_tensor(x.astype(np.float32)), tables.cos)
    y, dx = run(x.astype(np.float32))
    # the angles are float32 (pos · f in float32): the tolerance counts the angle's rounding
    n = float(L * 3 + 5)
    numerics.assert_close(y, want_y, n=n, what="y")
    numerics.assert_close(dx, want_dx, n=n, what="dx")
    numerics.assert_rejects(_rotary_ref(dy, pos.astype(np.float64), inv, interleaved), want_dx, n=n)
    # The Paddle-op path (taken by any other dtype) computes the same rotation.
    xt = paddle.to_tensor(x.astype(np.float32)).astype("float64")
    xt.stop_gradient = False
    ref = apply_rotary(xt, tables)
    numerics.assert_close(ref.numpy(), want_y, n=n, what="y, Paddle ops")


def test_rms_norm_with_a_frozen_weight_or_input() -> None:
    """LoRA freezes the norm's weight, a frozen embedding's output takes no gradient: the
    numpy norm returns gradients only for what takes one, the same dx / dw as when both do."""
    x = RNG.standard_normal((5, 32)).astype(np.float32)
    w = RNG.uniform(0.5, 1.5, 32).astype(np.float32)
    dy = RNG.standard_normal((5, 32)).astype(np.float32)
    both = _grads(lambda a, b: cpu_elementwise.rms_norm(a, b, 1e-5), [x, w], dy, "float32")
    for frozen in (0, 1):
        xt, wt = (paddle.to_tensor(a, stop_gradient=(i == frozen)) for i, a in enumerate((x, w)))
        cpu_elementwise.rms_norm(xt, wt, 1e-5).backward(paddle.to_tensor(dy))
        assert (xt.grad is None, wt.grad is None) == (frozen == 0, frozen == 1)
        live = wt if frozen == 0 else xt
        np.testing.assert_array_equal(live.grad.numpy(), both[2 - frozen].astype(np.float32))


# -- log p(label): the loss's numpy log-softmax ------------------------------------------------


def _logsoftmax64(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (the reference both paths are held to)."""
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _label_lp(x: np.ndarray, y: np.ndarray, dy: np.ndarray, ignore: int = -100):
    """The numpy path on fresh float32 logits: log p(label) and d <lp, dy> / d logits."""
    logits = paddle.to_tensor(x.astype(np.float32), stop_gradient=False)
    assert cpu_elementwise.applies(logits)
    lp = cpu_elementwise.label_logprobs(logits * 1.0, paddle.to_tensor(y), ignore)
    lp.backward(paddle.to_tensor(dy.astype(np.float32)))
    return lp.numpy().astype(np.float64), logits.grad.numpy().astype(np.float64)


@pytest.mark.parametrize(("shape", "vocab", "offset"), [((37,), 1000, 0.0), ((2, 9), 300, 100.0),
                                                        ((5,), 40_000, -50.0)])  # fmt: skip
def test_label_logprobs_match_float64(shape: tuple[int, ...], vocab: int, offset: float) -> None:
    """Values and the logits' gradient against float64, ignored labels exactly 0 with zero
    gradient rows. Offset 100: exp of an unshifted logit overflows float32 (the max shift
    shows); 40k vocabulary: several row blocks' worth of elements in one row."""
    x = RNG.standard_normal((*shape, vocab)) * 3 + offset
    x = x.astype(np.float32).astype(np.float64)  # the float32 inputs, exactly
    y = RNG.integers(0, vocab, shape)
    y.flat[1] = y.flat[-1] = -100
    dy = RNG.standard_normal(shape)
    got_lp, got_dx = _label_lp(x, y, dy)
    ignored = y == -100
    logp = _logsoftmax64(x)
    safe = np.where(ignored, 0, y)
    want_lp = np.where(ignored, 0.0, np.take_along_axis(logp, safe[..., None], -1)[..., 0])
    onehot = np.eye(vocab)[safe]
    want_dx = np.where(ignored[..., None], 0.0, dy[..., None] * (onehot - np.exp(logp)))
    numerics.assert_close(got_lp, want_lp, n=vocab, scale=np.abs(x).max(), what="log p")
    numerics.assert_close(got_dx, want_dx, n=vocab, norm="l2", what="dx")
    assert (got_lp[ignored] == 0).all() and (got_dx[ignored] == 0).all()
    # Negative controls: the backward without the one-hot, the log-sum-exp without the shift
    numerics.assert_rejects(-dy[..., None] * np.exp(logp), want_dx, n=vocab, norm="l2")
    x32 = x.astype(np.float32)
    with np.errstate(over="ignore"):
        unshifted = np.take_along_axis(x32, safe[..., None], -1)[..., 0] - np.log(
            np.exp(x32).sum(-1)
        )
    if offset > 88:  # exp overflows float32 beyond ~88.7
        numerics.assert_rejects(np.where(ignored, 0, unshifted), want_lp, n=vocab,
                                scale=np.abs(x).max())  # fmt: skip


def test_label_logprobs_equal_paddle_cross_entropy_and_check_labels() -> None:
    """The same function as `-F.cross_entropy(reduction="none")` (any ignore_index); a label
    outside the vocabulary raises IndexError naming it, as Paddle's does, before compute."""
    vocab = 50
    x = (RNG.standard_normal((6, vocab)) * 4).astype(np.float32)
    y = np.array([3, 7, 0, 49, 7, 1])
    dy = RNG.standard_normal(6)
    got = _label_lp(x, y, dy, ignore=7)
    xt = paddle.to_tensor(x, stop_gradient=False)
    ref = -paddle.nn.functional.cross_entropy(
        xt, paddle.to_tensor(y), reduction="none", ignore_index=7
    )
    ref.backward(paddle.to_tensor(dy.astype(np.float32)))
    numerics.assert_close(got[0], ref.numpy(), n=vocab, scale=np.abs(x).max(), what="log p")
    numerics.assert_close(got[1], xt.grad.numpy(), n=vocab, norm="l2", what="dx")
    assert (got[0][[1, 4]] == 0).all() and (got[1][[1, 4]] == 0).all()
    for bad in (vocab, -5):
        with pytest.raises(IndexError, match=f"label value {bad} is outside the vocabulary"):
            cpu_elementwise.label_logprobs(paddle.to_tensor(x[:2]), paddle.to_tensor([1, bad]), 7)
        with pytest.raises(IndexError):  # what Paddle's cross-entropy does with it
            paddle.nn.functional.cross_entropy(
                paddle.to_tensor(x[:2]), paddle.to_tensor([1, bad]), reduction="none"
            )


def test_label_logprobs_own_their_logits() -> None:
    """The backward turns the logits into their gradient in place: an op that saved the same
    logits for its own backward raises rather than read the overwritten buffer. Without grad
    nothing is kept, and the values are those with grad."""
    x = RNG.standard_normal((4, 30)).astype(np.float32)
    y = paddle.to_tensor([1, 2, 3, 4])
    xt = paddle.to_tensor(x, stop_gradient=False)
    lp = cpu_elementwise.label_logprobs(xt * 1.0, y, -100)
    z = paddle.to_tensor(x, stop_gradient=False)
    e = paddle.exp(z)  # exp saves its output for backward: the logits here
    with pytest.raises(Exception, match="modified by an inplace operation"):
        cpu_elementwise.label_logprobs(e, y, -100).sum().backward()
    # strided logits (a transposed view) are made contiguous first: the same values
    wide = paddle.to_tensor(np.ascontiguousarray(x.T), stop_gradient=False)
    strided = cpu_elementwise.label_logprobs(wide.t(), y, -100)
    numerics.assert_close(strided.numpy(), lp.numpy(), n=30, what="strided")
    strided.sum().backward()
    np.testing.assert_array_equal(wide.numpy(), x.T)  # the caller's buffer is not written
    with paddle.no_grad():
        kept = paddle.to_tensor(x)
        free = cpu_elementwise.label_logprobs(kept, y, -100)
    np.testing.assert_array_equal(free.numpy(), lp.numpy())
    np.testing.assert_array_equal(kept.numpy(), x)  # no backward to come: left as they were


def test_token_logprobs_takes_numpy_only_for_owned_float32_cpu_logits() -> None:
    """`models.head.token_logprobs`: logits it owns, float32 on CPU, go to the numpy layer;
    logits the caller keeps (`owned=False`) or of another dtype take Paddle's cross-entropy."""
    from flashcp.models import head

    x = paddle.to_tensor(RNG.standard_normal((3, 20)).astype(np.float32))
    y = paddle.to_tensor([0, 5, -100])
    calls: list[int] = []
    real = cpu_elementwise.label_logprobs

    def counted(*args):
        calls.append(1)
        return real(*args)

    cpu_elementwise.label_logprobs = counted
    try:
        a = head.token_logprobs(x, y, owned=True)
        b = head.token_logprobs(x, y)
        c = head.token_logprobs(x.astype("bfloat16"), y, owned=True)
    finally:
        cpu_elementwise.label_logprobs = real
    assert calls == [1]
    numerics.assert_close(a.numpy(), b.numpy(), n=20, what="numpy vs Paddle")
    assert c.dtype == paddle.float32 and c.numpy()[2] == 0
