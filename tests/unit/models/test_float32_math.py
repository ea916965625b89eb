"""Where flashcp promises float32 it computes float32 on a GPU too (issue 21 items 5 and 6):
the MoE router's affinities and the MoE combine run with autocast off and TF32 off
(`flashcp.models.precision.float32_math`), forward and backward.

No GPU here, so the two GPU behaviours are emulated, each with a negative control showing the
emulation bites:

* TF32: Paddle's switch (`paddle.base.core.set_cublas_switch`, CUDA builds only) is replaced by
  a fake, and `paddle.matmul` records the switch's state at each call; the switch is
  restored afterwards and a matmul outside stays under TF32. The router's choices on
  near-ties equal a float64 reference, which TF32-rounded inputs (10-bit mantissa) miss.
* bf16 O1 autocast: on CPU `paddle.amp.auto_cast` does nothing (Paddle's guard disables it off
  a GPU), so an emulation replaces it — while enabled, `paddle.matmul` (on Paddle's O1 white
  list, `paddle/amp/amp_lists.py`) rounds its inputs to bf16 and returns bf16, as a GPU O1
  matmul does. The combine inside its PyLayer stays float32 under it and equals a float64
  reference within the float32 rule; without `float32_math` it is bf16.

The gpu-marked tests run the router and the combine for real under bf16 autocast and TF32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.models import moe_dispatch, precision, preset
from flashcp.models.moe import TopkRouter
from flashcp.models.moe_dispatch import build_dispatch, combine

H, E, K = 64, 8, 2
NEAR_H = 8
"""Hidden size of the near-tie router: the float32 rule's allowance for one logit grows as
n·√n (`numerics.tolerance` with scale Σ|x·w|) and TF32's rounding as √n, so a short dot product
leaves a wide window of gaps that float32 resolves and TF32 does not."""


class FakeTf32:
    """Paddle's TF32 switch as a plain flag; on by default, as Paddle's is on a GPU."""

    def __init__(self, on: bool | None = True) -> None:
        self.on = on
        self.sets: list[bool] = []

    def get(self) -> bool | None:
        return self.on

    def set(self, on: bool) -> None:
        self.sets.append(on)
        self.on = on


@pytest.fixture
def tf32(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeTf32, list[bool]]]:
    """The fake switch, and the switch's state at every `paddle.matmul` call since."""
    switch = FakeTf32()
    seen: list[bool] = []
    real = paddle.matmul

    def matmul(*args: object, **kwargs: object) -> paddle.Tensor:
        seen.append(bool(switch.on))
        return real(*args, **kwargs)

    monkeypatch.setattr(precision, "TF32", switch)
    monkeypatch.setattr(paddle, "matmul", matmul)
    yield switch, seen


def test_float32_math_turns_tf32_off_inside_and_restores_it(tf32) -> None:
    switch, _ = tf32
    with precision.float32_math():
        assert switch.on is False
        with precision.float32_math():  # nested: still off, then back to off
            assert switch.on is False
        assert switch.on is False
    assert switch.on is True and switch.sets == [False, True]
    switch.on, switch.sets = False, []  # already off: left alone
    with precision.float32_math():
        assert switch.on is False
    assert switch.on is False and switch.sets == []


def test_a_cpu_build_has_no_switch_to_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    switch = FakeTf32(on=None)
    monkeypatch.setattr(precision, "TF32", switch)
    with precision.float32_math():
        pass
    assert switch.sets == []
    if not paddle.is_compiled_with_cuda():  # the real one: bound on this build, always off
        assert precision.Tf32Switch().get() is False


def test_router_runs_with_tf32_off_forward_and_backward(tf32) -> None:
    switch, seen = tf32
    paddle.seed(0)
    router = TopkRouter(preset("tiny_glm_moe"))
    x = paddle.randn([6, int(router.weight.shape[0])])
    x.stop_gradient = False
    routing = router.route(x)
    assert seen == [False] and routing.scores.dtype == paddle.float32
    routing.weights.sum().backward()
    assert seen == [False, False, False]  # and both gradient matmuls
    assert x.grad is not None and router.weight.grad is not None
    assert switch.on is True
    paddle.matmul(x, router.weight)  # negative control: outside, TF32 as Paddle has it
    assert seen[-1] is True


def test_combine_runs_with_tf32_off_forward_and_backward(
    tf32, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, seen = tf32
    monkeypatch.setattr(moe_dispatch, "applies", lambda *tensors: False)  # the GPU's bodies
    y, d, w = _combine_inputs()
    out = combine(y, d, w)
    (out * 1.5).sum().backward()
    assert len(seen) == 2 and not any(seen)  # the weighted sum, and the weights' gradient


def _combine_inputs(seed: int = 0) -> tuple[paddle.Tensor, moe_dispatch.Dispatch, paddle.Tensor]:
    """Expert rows `y` (bf16-valued: what a bf16 grouped GEMM outputs), a dispatch, weights."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(32)])
    d = build_dispatch(paddle.to_tensor(ids), E)
    y = paddle.to_tensor(rng.standard_normal((d.rows, H)).astype("float32"))
    y = y.astype("bfloat16").astype("float32")
    y.stop_gradient = False
    w = paddle.to_tensor(rng.uniform(0.1, 1.0, (32, K)).astype("float32"))
    w.stop_gradient = False
    return y, d, w


@contextlib.contextmanager
def emulated_o1(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """bf16 O1 autocast as a GPU applies it to `paddle.matmul` (module docstring)."""
    depth: list[bool] = []
    real_auto_cast, real_matmul = paddle.amp.auto_cast, paddle.matmul

    @contextlib.contextmanager
    def auto_cast(enable: bool = True, **kwargs: object) -> Iterator[None]:
        depth.append(bool(enable))
        try:
            with real_auto_cast(enable=False):
                yield
        finally:
            depth.pop()

    def matmul(x: paddle.Tensor, y: paddle.Tensor, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if depth and depth[-1]:
            x16 = x.astype("bfloat16").astype("float32")
            y16 = y.astype("bfloat16").astype("float32")
            return real_matmul(x16, y16, *args, **kwargs).astype("bfloat16")
        return real_matmul(x, y, *args, **kwargs)

    monkeypatch.setattr(paddle.amp, "auto_cast", auto_cast)
    monkeypatch.setattr(paddle, "matmul", matmul)
    yield


def _combine_reference(y: paddle.Tensor, d: moe_dispatch.Dispatch, w: paddle.Tensor) -> np.ndarray:
    slot = d.slot.numpy().reshape(-1, K)
    rows = y.numpy().astype(np.float64)[slot]  # [T, k, H]
    return np.einsum("tk,tkh->th", w.numpy().astype(np.float64), rows)


def test_combine_stays_float32_under_bf16_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_dispatch, "applies", lambda *tensors: False)  # the GPU's bodies
    y, d, w = _combine_inputs(1)
    want = _combine_reference(y, d, w)
    scale = float(np.abs(want).max())
    with emulated_o1(monkeypatch):
        # the emulation bites: a plain matmul under it is bf16
        with paddle.amp.auto_cast(dtype="bfloat16", level="O1"):
            plain = paddle.matmul(y, paddle.ones([H, 1]))
            out = combine(y, d, w)
        assert plain.dtype == paddle.bfloat16
        assert out.dtype == paddle.float32
        numerics.assert_close(out.numpy(), want, n=K, scale=scale, what="combine under O1")
        # negative control: the same combine without float32_math is rounded to bf16
        monkeypatch.setattr(moe_dispatch, "float32_math", contextlib.nullcontext)
        with paddle.amp.auto_cast(dtype="bfloat16", level="O1"):
            rounded = combine(y, d, w)
    assert rounded.dtype == paddle.bfloat16
    numerics.assert_rejects(rounded.astype("float32").numpy(), want, n=K, scale=scale)


def test_router_stays_float32_under_bf16_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    x, router = _near_ties()
    want = router.route(x).scores.numpy()
    with emulated_o1(monkeypatch), paddle.amp.auto_cast(dtype="bfloat16", level="O1"):
        got = router.route(x).scores
    assert got.dtype == paddle.float32
    np.testing.assert_array_equal(got.numpy(), want)


# -- near-ties -----------------------------------------------------------------------------


def _near_ties(tokens: int = 2048, seed: int = 0) -> tuple[paddle.Tensor, TopkRouter]:
    """Tokens whose E affinities are near-ties: every expert's gate column is one shared column
    plus 1.5e-4 of its own, so the logits (~3) differ by ~1e-4 — beyond float32's rounding,
    below TF32's (~1e-3 relative); the correction bias is 0."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(NEAR_H)
    w = (base[:, None] + 1.5e-4 * rng.standard_normal((NEAR_H, E))).astype("float32")
    x = rng.standard_normal((tokens, NEAR_H)).astype("float32")
    router = TopkRouter(preset("tiny_glm_moe", hidden_size=NEAR_H, num_heads=1, num_kv_heads=1,
                               num_experts=E, num_experts_per_tok=K))  # fmt: skip
    router.weight.set_value(paddle.to_tensor(w))
    return paddle.to_tensor(x), router


def _float64_choices(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top-k experts as sorted sets, the gap between the k-th and (k+1)-th logit, the float32
    rule's allowance for one logit: n = NEAR_H products of total magnitude Σ|x·w|)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    logits = x64 @ w64
    order = np.argsort(-logits, axis=1, kind="stable")
    ranked = np.take_along_axis(logits, order, axis=1)
    gap = ranked[:, K - 1] - ranked[:, K]
    scale = (np.abs(x64) @ np.abs(w64)).max(1)
    allowed = np.array([numerics.tolerance(NEAR_H, s) for s in scale])
    return np.sort(order[:, :K], axis=1), gap, allowed


def _tf32(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 explicit mantissa bits, to nearest)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def test_router_choices_equal_float64_on_near_ties() -> None:
    x, router = _near_ties()
    xn, wn = x.numpy(), router.weight.numpy()
    want, gap, allowed = _float64_choices(xn, wn)
    resolved = gap > 2 * allowed  # float32 must order these right
    logits = xn.astype(np.float64) @ wn.astype(np.float64)
    near = resolved & (gap < 2.0**-11 * np.abs(logits).max(1))  # below TF32's rounding
    assert near.sum() >= 100, near.sum()
    got = np.sort(router.route(x).ids.numpy(), axis=1)
    assert (got[resolved] == want[resolved]).all()
    # negative control: the same router on TF32-rounded inputs chooses otherwise on near-ties
    x32, w32 = _tf32(xn), _tf32(wn)
    tf32 = np.sort(np.argsort(-(x32.astype(np.float64) @ w32), axis=1)[:, :K], axis=1)
    wrong = (tf32[near] != want[near]).any(axis=1).mean()
    assert wrong > 0.2, wrong


@pytest.mark.gpu
def test_gpu_router_choices_equal_float64_on_near_ties_under_tf32_and_autocast() -> None:
    paddle.set_device("gpu")
    try:
        x, router = _near_ties()
        want, gap, allowed = _float64_choices(x.numpy(), router.weight.numpy())
        resolved = gap > 2 * allowed
        assert precision.TF32.get() is True  # Paddle's default: TF32 on
        with paddle.amp.auto_cast(enable=True, dtype="bfloat16", level="O1"):
            routing = router.route(x)
        assert routing.scores.dtype == paddle.float32
        got = np.sort(routing.ids.numpy(), axis=1)
        assert (got[resolved] == want[resolved]).all()
        assert precision.TF32.get() is True  # restored
    finally:
        paddle.set_device("cpu")


@pytest.mark.gpu
def test_gpu_combine_is_float32_under_bf16_autocast() -> None:
    paddle.set_device("gpu")
    try:
        y, d, w = _combine_inputs(2)
        want = _combine_reference(y, d, w)
        with paddle.amp.auto_cast(enable=True, dtype="bfloat16", level="O1"):
            out = combine(y, d, w)
        assert out.dtype == paddle.float32
        numerics.assert_close(out.numpy(), want, n=K, scale=float(np.abs(want).max()))
    finally:
        paddle.set_device("cpu")
