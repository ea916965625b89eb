"""A tiny language model stored in bfloat16 that computes in float32, for optimizer tests.

Paddle 3.3.1 has no bfloat16 matmul on CPU, so the parameters (bfloat16 storage) are cast to
float32 inside `forward`: their gradients come back through the casts in bfloat16, which is
what the float32 `main_grad` accumulation and master weights of `flashcp.trainer.zero` exist
for. Position-wise (no attention), so any context-parallel split of a sequence gives the same
per-token losses; same call signature as flashcp's models (`ids, positions, attention`).
Parameters: a 2-D embedding, hidden matrix and head (weight decay) and a 1-D bias and scale
(no weight decay).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F


class Bf16ToyLM(paddle.nn.Layer):
    """Embedding → tanh(h·W + b) · scale → head; parameters in `dtype`, compute in float32."""

    def __init__(self, vocab: int = 260, hidden: int = 24, seed: int = 0, dtype: str = "bfloat16"):
        super().__init__()
        rng = np.random.default_rng(seed)
        shapes = {
            "embed": ([vocab, hidden], 0.5),
            "w": ([hidden, hidden], 0.3),
            "b": ([hidden], 0.1),
            "scale": ([hidden], 0.0),
            "head": ([hidden, vocab], 0.3),
        }
        for name, (shape, std) in shapes.items():
            value = rng.normal(0.0, std, shape) if std else np.ones(shape)
            p = self.create_parameter(
                shape, dtype=dtype, default_initializer=paddle.nn.initializer.Constant(0.0)
            )
            p.set_value(paddle.to_tensor(value.astype(np.float32)).astype(dtype))
            setattr(self, name, p)

    def forward(self, ids: paddle.Tensor, positions: Any = None, attn: Any = None) -> paddle.Tensor:
        f32 = {n: p.astype("float32") for n, p in self.named_parameters()}
        h = F.embedding(ids, f32["embed"])
        h = paddle.tanh(paddle.matmul(h, f32["w"]) + f32["b"]) * f32["scale"]
        return paddle.matmul(h, f32["head"])
