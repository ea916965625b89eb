"""`flashcp.kernels.numpy_bridge.matmul`: the CPU kernel's GEMMs through Paddle, numpy in and out.

Each product is checked against a float64 numpy product under the rule of `bench.numerics`
(n = the inner dimension), with a negative control (the operand not transposed) that the same
comparison must reject; products are writable numpy scratch Paddle's allocator does not see,
`empty` gives Paddle memory numpy fills, and autocast must not lower a product's precision.
"""

from __future__ import annotations

import gc

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.kernels.numpy_bridge import empty, matmul, view

RNG = np.random.default_rng(7)


def _pair(shape_a: tuple[int, ...], shape_b: tuple[int, ...], dtype=np.float32):
    return (RNG.standard_normal(shape_a).astype(dtype), RNG.standard_normal(shape_b).astype(dtype))


@pytest.mark.parametrize(
    ("ta", "tb", "shape_a", "shape_b"),
    [
        (False, False, (3, 40, 24), (3, 24, 17)),
        (False, True, (2, 40, 24), (2, 17, 24)),  # S = Q Kᵀ
        (True, False, (2, 24, 40), (2, 24, 17)),  # dV = Pᵀ dO
        (True, True, (24, 40), (17, 24)),
    ],
)
def test_products_match_float64_and_transposes_are_applied(ta, tb, shape_a, shape_b) -> None:
    a, b = _pair(shape_a, shape_b)
    a64 = np.swapaxes(a, -1, -2) if ta else a
    b64 = np.swapaxes(b, -1, -2) if tb else b
    want = a64.astype(np.float64) @ b64.astype(np.float64)
    got = matmul(a, b, transpose_a=ta, transpose_b=tb)
    assert got.dtype == np.float32 and got.shape == want.shape
    numerics.assert_close(got, want, n=a64.shape[-1])


def test_transpose_flag_is_not_ignored() -> None:
    """Negative control for the flags: a square `b` transposed or not gives different products,
    and the comparison tells them apart."""
    a, b = _pair((2, 16, 16), (2, 16, 16))
    want = a.astype(np.float64) @ np.swapaxes(b, -1, -2).astype(np.float64)
    numerics.assert_close(matmul(a, b, transpose_b=True), want, n=16)
    numerics.assert_rejects(matmul(a, b), want, n=16)


def test_float64_stays_float64() -> None:
    a, b = _pair((5, 33), (33, 9), dtype=np.float64)
    got = matmul(a, b)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def test_products_are_numpy_scratch_not_paddle_memory() -> None:
    """The kernel's tiles are scratch: Paddle's allocator (what `flashcp.metrics.memory` and
    the planner's measured tests read) must not see them, as it never saw numpy's."""
    from flashcp.metrics.memory import allocated_bytes

    a, b = _pair((4, 256, 64), (4, 64, 512))
    before = allocated_bytes()
    got = matmul(a, b)
    assert allocated_bytes() == before
    assert got.flags.writeable and got.flags.c_contiguous and got.flags.owndata
    got *= 2.0  # the kernel exponentiates and rescales its tiles in place
    # negative control: Paddle's own product is allocator memory
    kept = paddle.matmul(paddle.to_tensor(a), paddle.to_tensor(b))
    assert allocated_bytes() - before >= kept.numel() * 4


def test_empty_is_a_paddle_tensor_numpy_fills() -> None:
    """`empty`: numpy writes land in the Paddle tensor, which the view keeps alive."""
    from flashcp.metrics.memory import allocated_bytes

    before = allocated_bytes()
    tensor, arr = empty((3, 5), np.dtype(np.float32))
    assert allocated_bytes() - before >= 3 * 5 * 4  # counted by Paddle's allocator
    arr[...] = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(tensor.numpy(), arr)
    del tensor
    gc.collect()
    for _ in range(20):  # churn the allocator: a freed buffer would be reused and overwritten
        paddle.full([3, 5], -1.0)
    np.testing.assert_array_equal(arr, np.arange(15, dtype=np.float32).reshape(3, 5))
    assert view(paddle.to_tensor(arr)).dtype == np.float32


def test_strided_operands_are_read_as_their_values() -> None:
    """The kernel passes key ranges of a `[n_kv, Sk, D]` array (strided for n_kv > 1)."""
    k = RNG.standard_normal((3, 50, 8)).astype(np.float32)
    q = RNG.standard_normal((3, 20, 8)).astype(np.float32)
    part = k[:, 10:30]
    assert not part.flags.c_contiguous
    want = q.astype(np.float64) @ np.swapaxes(part, -1, -2).astype(np.float64)
    numerics.assert_close(matmul(q, part, transpose_b=True), want, n=8)


def test_mixed_dtypes_are_refused() -> None:
    a, _ = _pair((4, 4), (4, 4))
    with pytest.raises(TypeError, match="float32 and float64"):
        matmul(a, a.astype(np.float64))


@pytest.mark.parametrize("amp_dtype", ["bfloat16", "float16"])
def test_autocast_leaves_the_kernels_gemms_in_float32(amp_dtype: str) -> None:
    """The kernel runs inside a PyLayer under its caller's autocast; Paddle's autocast must not
    lower a CPU product to 16 bits (the error would be ~1e-2 of the scale, far over the rule)."""
    a, b = _pair((2, 64, 256), (2, 256, 32))
    want = a.astype(np.float64) @ b.astype(np.float64)
    with paddle.amp.auto_cast(enable=True, dtype=amp_dtype, level="O1"):
        got = matmul(a, b)
    assert got.dtype == np.float32
    numerics.assert_close(got, want, n=256)
    # Negative control: the product of 16-bit-rounded operands, what a lowered GEMM would give.
    low_a, low_b = (paddle.to_tensor(x).astype(amp_dtype).astype("float64").numpy() for x in (a, b))
    numerics.assert_rejects(low_a @ low_b, want, n=256, margin=4)


@pytest.mark.parametrize(("shape_a", "shape_b"), [((3, 20, 8), (8, 5)), ((20, 8), (3, 8, 5))])
def test_batch_axes_broadcast_as_numpys(shape_a, shape_b) -> None:
    """Either operand may lack the batch axes (numpy's matmul broadcasting)."""
    a, b = _pair(shape_a, shape_b)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    got = matmul(a, b)
    assert got.shape == want.shape == (3, 20, 5)
    numerics.assert_close(got, want, n=8)


def test_empty_has_the_asked_dtype_on_the_cpu() -> None:
    tensor, arr = empty((2, 3), np.dtype(np.float64))
    assert arr.dtype == np.float64 and tensor.dtype == paddle.float64
    assert tensor.place.is_cpu_place()
