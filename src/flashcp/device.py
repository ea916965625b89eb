"""The current Paddle device, asked in one place (a leaf: every layer may import it)."""

from __future__ import annotations

import numpy as np
import paddle


def on_gpu() -> bool:
    """Whether Paddle's current device is a GPU."""
    return bool(paddle.is_compiled_with_cuda()) and "gpu" in str(paddle.get_device())


def host_array(tensor: paddle.Tensor) -> np.ndarray:
    """`tensor` copied to host memory as numpy, untouched by later changes to `tensor` (what a
    checkpoint is written from, possibly while training goes on).

    On CPU `Tensor.numpy()`, itself a copy. From a GPU the copy is one DMA into pinned memory
    (`Tensor.pin_memory`), which numpy then views through DLPack without another copy; a dtype
    numpy lacks (bfloat16, kept as its uint16 bits like `Tensor.numpy()` keeps it) or a DLPack
    numpy refuses is copied once more, to pageable memory.
    """
    if not tensor.place.is_gpu_place():
        return tensor.numpy()
    pinned = tensor.pin_memory()
    if tensor.dtype != paddle.bfloat16:
        try:
            return np.from_dlpack(pinned)
        except (BufferError, RuntimeError, TypeError):
            pass
    return pinned.numpy()
