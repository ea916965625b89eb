"""`flashcp.device.host_array`: the host copy a checkpoint is written from must not change when
training changes the tensor afterwards (an asynchronous save writes it during later steps)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp.device import host_array


def _check_independent_copy(tensor: paddle.Tensor) -> np.ndarray:
    want = tensor.numpy().copy()
    got = host_array(tensor)
    with paddle.no_grad():
        tensor.set_value(tensor + paddle.ones_like(tensor))  # the next optimizer step
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype and got.shape == want.shape
    return got


def test_cpu_copy_is_independent_of_the_tensor() -> None:
    _check_independent_copy(paddle.arange(12, dtype="float32").reshape([3, 4]))
    p = paddle.create_parameter([2, 3], "float32")
    _check_independent_copy(p)


def test_negative_control_a_view_is_not_a_copy() -> None:
    """What the check catches: a zero-copy view (DLPack) of a CPU tensor follows it."""
    t = paddle.arange(4, dtype="float32")
    view = np.from_dlpack(t)
    with paddle.no_grad():
        t.add_(paddle.ones_like(t))
    assert view.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_copy_is_pinned_or_pageable_and_independent(dtype: str) -> None:
    paddle.set_device("gpu")
    try:
        t = paddle.arange(12, dtype="float32").reshape([3, 4]).astype(dtype)
        got = _check_independent_copy(t)
        if dtype == "bfloat16":
            assert got.dtype == np.uint16  # the bits, as Tensor.numpy() gives them
    finally:
        paddle.set_device("cpu")
