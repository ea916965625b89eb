"""numpy arrays on Paddle's CPU buffers: Paddle's GEMM for numpy operands, Paddle-owned outputs.

flashcp's CPU code that runs in numpy — the FlashMask kernel (`cpu_forward`, `cpu_backward`)
and the element-wise layers (`flashcp.models.cpu_elementwise`) — does its element-wise work in
numpy, 3-5x faster than Paddle's CPU element-wise ops at a step's shapes, and two things here:

* `matmul`: its matrix multiplies through Paddle's CPU matmul, about 5x faster than numpy's
  bundled OpenBLAS at the kernel's shapes (`docs/bench_kernel.md`, its column "kernel GEMM /
  numpy GEMM", timed side by side by `scripts/bench_kernel.py`). Operands and product stay
  numpy arrays; Paddle reads and writes them through DLPack (no copies).
* `empty`: outputs allocated by Paddle and filled by numpy in place (`out=`), so what a layer
  keeps is Paddle memory that Paddle's allocator, and so `flashcp.metrics.memory` and the
  planner's measured tests, see (numpy's own arrays are invisible to it).

A view of a Paddle tensor keeps it alive as its numpy base. Paddle's autocast leaves matmuls of
CPU tensors alone, so the products are in the operands' dtype under any autocast (pinned by
`tests/unit/kernels/test_numpy_bridge.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle


class _PaddleBuffer:
    """A Paddle CPU tensor seen as a numpy array (`__array_interface__`), kept alive as its base."""

    def __init__(self, tensor: Any, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "shape": tuple(int(n) for n in tensor.shape),
            "typestr": dtype.str,
            "data": (tensor.data_ptr(), False),
            "version": 3,
        }


def view(tensor: paddle.Tensor) -> np.ndarray:
    """A writable numpy view of a contiguous Paddle CPU tensor's buffer."""
    dtype = np.dtype(str(tensor.dtype).removeprefix("paddle."))
    return np.asarray(_PaddleBuffer(tensor, dtype))


def empty(shape: tuple[int, ...], dtype: np.dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """A new Paddle CPU tensor and a writable numpy view of it, for numpy to fill."""
    tensor = paddle.empty(list(shape), dtype=np.dtype(dtype).name, device=paddle.CPUPlace())
    return tensor, view(tensor)


def matmul(
    a: np.ndarray, b: np.ndarray, *, transpose_a: bool = False, transpose_b: bool = False
) -> np.ndarray:
    """`a @ b` (either operand transposed in its last two axes first), batched over leading axes.

    Both operands of one float dtype; the result is a new C-contiguous numpy array of it, which
    Paddle's GEMM writes in place (`out=`): kernel scratch, numpy's like the kernel's other
    temporaries, not Paddle allocator memory.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"matmul operands differ in dtype: {a.dtype} and {b.dtype}")
    m = a.shape[-1] if transpose_a else a.shape[-2]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    out = np.empty((*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n), dtype=a.dtype)
    paddle.matmul(
        paddle.utils.dlpack.from_dlpack(np.ascontiguousarray(a)),
        paddle.utils.dlpack.from_dlpack(np.ascontiguousarray(b)),
        transpose_x=transpose_a,
        transpose_y=transpose_b,
        out=paddle.utils.dlpack.from_dlpack(out),
    )
    return out
