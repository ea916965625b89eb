"""The current Paddle device, asked in one place (a leaf: every layer may import it)."""

from __future__ import annotations

import paddle


def on_gpu() -> bool:
    """Whether Paddle's current device is a GPU."""
    return bool(paddle.is_compiled_with_cuda()) and "gpu" in str(paddle.get_device())
