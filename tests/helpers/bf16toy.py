"""A tiny language model stored in bfloat16 that computes in float32, for optimizer tests.

Paddle 3.3.1 has no bfloat16 matmul on CPU, so the parameters (bfloat16 storage) are cast to
float32 inside `forward`: their gradients come back through the casts in bfloat16, which is what
the float32 `main_grad` accumulation and master weights of `flashcp.optim.master_optimizer`
exist for. Position-wise (no attention), so any context-parallel split of a sequence gives the
same per-token losses; same call signature and contract as flashcp's models (`ids, positions,
attention` to the final hidden states; `logits` / `token_logprobs` apply the head, the latter
over token chunks like `flashcp.models.LMHead`). Parameters: a 2-D embedding, hidden matrix and
head (weight decay) and a 1-D bias and scale (no weight decay).
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

    # One whole model: the pipeline-stage facts the runner reads (`flashcp.pipeline.runner`).
    stage, num_stages, is_first, is_last, tied_weight = 0, 1, True, True, None
    activation_dtype = paddle.float32

    def activation_shape(self, tokens_shape: Any) -> list[int]:
        return [*(int(d) for d in tokens_shape), int(self.w.shape[0])]

    def forward(self, ids: paddle.Tensor, positions: Any = None, attn: Any = None) -> paddle.Tensor:
        """The final hidden states `[B, L, hidden]` (float32)."""
        h = F.embedding(ids, self.embed.astype("float32"))
        w, b = self.w.astype("float32"), self.b.astype("float32")
        return paddle.tanh(paddle.matmul(h, w) + b) * self.scale.astype("float32")

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(hidden, self.head.astype("float32"))

    def token_logprobs(self, hidden: paddle.Tensor, labels: paddle.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
        from flashcp.models import chunked_token_logprobs

        return chunked_token_logprobs(self.logits, hidden, labels, **kw)
