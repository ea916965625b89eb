"""GLM-4.5 mixture of experts: sigmoid top-k router, routed experts, shared experts.

Routing (HF ``Glm4MoeTopkRouter``, from DeepSeek-V3), per token in float32:

1. ``scores = sigmoid(x @ W_gate)`` over the E routed experts;
2. choose the top-k of ``scores + e_score_correction_bias`` — the bias (a persistent buffer
   that load balancing nudges between steps; no gradient) steers selection only;
3. weights are the RAW scores of the chosen experts, divided by their sum when
   `norm_topk_prob`, then multiplied by `routed_scaling_factor`.

The layer output is ``sum_k w_k · expert_k(x) + shared_experts(x)``. GLM-4.5-Air uses one
expert group (``n_group = topk_group = 1``), so group-limited selection is not implemented.

No expert parallelism: every rank holds every expert and loops over them in index order,
gathering its tokens (`index_select`) and adding the weighted outputs back (`index_add`).
Each expert's token indices are unique and experts are visited in a fixed order, so the
result is deterministic. Experts that receive no token are skipped (their grads stay None).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from flashcp.models.config import ModelArgs
from flashcp.models.init import normal_attr
from flashcp.models.layers import SwiGLU
from flashcp.models.precision import as_dtype


class TopkRouter(nn.Layer):
    """The gate: weight `[hidden, E]` (Paddle orientation; HF stores `[E, hidden]`), stored in
    the parameter dtype and used in float32; the correction bias is a float32 buffer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.num_experts = args.num_experts
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = float(args.routed_scaling_factor)
        self.weight = self.create_parameter(
            [args.hidden_size, args.num_experts],
            attr=normal_attr(args.initializer_range),
        )
        self.register_buffer(
            "e_score_correction_bias",
            paddle.zeros([args.num_experts], dtype="float32"),
            persistable=True,
        )

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """`x` `[T, hidden]` → (expert ids `[T, k]` int64, weights `[T, k]` float32)."""
        logits = paddle.matmul(x.astype("float32"), as_dtype(self.weight, "float32"))
        scores = F.sigmoid(logits)
        choice = scores.detach() + self.e_score_correction_bias.unsqueeze(0)
        _, ids = paddle.topk(choice, k=self.top_k, axis=-1)
        weights = paddle.take_along_axis(scores, ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class MoE(nn.Layer):
    """Routed experts plus `num_shared_experts` shared experts fused into one SwiGLU."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        std = args.initializer_range
        self.gate = TopkRouter(args)
        self.experts = nn.LayerList(
            [
                SwiGLU(args.hidden_size, args.moe_intermediate_size, fused=False, std=std)
                for _ in range(args.num_experts)
            ]
        )
        self.shared_experts: SwiGLU | None = None
        if args.num_shared_experts > 0:
            self.shared_experts = SwiGLU(
                args.hidden_size,
                args.moe_intermediate_size * args.num_shared_experts,
                fused=False,
                std=std,
            )
        self.last_tokens_per_expert: np.ndarray | None = None  # routing stats of the last call

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        flat = x.reshape([-1, int(shape[-1])])
        ids, weights = self.gate(flat)
        out = paddle.zeros(flat.shape, dtype="float32")  # accumulate in float32, as HF does
        counts = np.zeros(len(self.experts), dtype=np.int64)
        for e, expert in enumerate(self.experts):
            hit = ids == e  # [T, k]; at most one True per row (top-k ids are distinct)
            tokens = paddle.nonzero(hit.any(axis=-1)).flatten()
            n = int(tokens.shape[0])
            counts[e] = n
            if n == 0:
                continue
            w = paddle.index_select((weights * hit.astype(weights.dtype)).sum(axis=-1), tokens)
            y = expert(paddle.index_select(flat, tokens)).astype("float32") * w.unsqueeze(-1)
            out = paddle.index_add(out, tokens, 0, y)
        self.last_tokens_per_expert = counts
        out = out.astype(x.dtype).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
