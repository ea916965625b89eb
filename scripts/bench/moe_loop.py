"""The per-expert loop MoE — flashcp's MoE before grouped expert compute — kept as the baseline
of the MoE benchmark (`bench.moe`) and as the tests' independent reference for the grouped path
(here, not under tests/, because no script imports from tests/).

`LoopMoE(moe)` holds the same weights as a grouped `flashcp.models.moe.MoE` in the OLD layout —
one `SwiGLU` (separate `gate_proj` / `up_proj` / `down_proj` Linears) per routed expert, copied
from the stacked slices — and shares its router and shared experts. Its forward is the old
loop: for every expert in index order find its tokens (`nonzero`, a host sync), gather them
(`index_select`), run the expert, weight the outputs and add them back (`index_add`) into a
float32 accumulator. `stacked_grads` puts the per-expert gradients back in the stacked layout
for comparison.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from flashcp.models.layers import SwiGLU


class LoopMoE(nn.Layer):
    """The old per-expert loop over per-expert Linear weights (see the module docstring)."""

    def __init__(self, moe: nn.Layer) -> None:
        super().__init__()
        grouped = moe.experts
        hidden, inter = grouped.hidden_size, grouped.intermediate_size
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        experts = []
        with paddle.no_grad():
            for e in range(grouped.num_experts):
                expert = SwiGLU(hidden, inter, fused=False, std=0.02)
                gate_up = grouped.gate_up_proj[e]
                for layer, value in (
                    (expert.gate_proj, gate_up[:, :inter]),
                    (expert.up_proj, gate_up[:, inter:]),
                    (expert.down_proj, grouped.down_proj[e]),
                ):
                    layer.weight = layer.create_parameter(
                        list(value.shape),
                        dtype=value.dtype,
                        default_initializer=nn.initializer.Assign(value.numpy()),
                    )
                experts.append(expert)
        self.experts = nn.LayerList(experts)
        self.last_tokens_per_expert: np.ndarray | None = None

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

    def stacked_grads(self) -> dict[str, np.ndarray]:
        """The routed experts' gradients as `gate_up_proj` `[E, H, 2I]` / `down_proj` `[E, I, H]`
        (zeros for an expert no token reached, whose gradients stay None)."""

        def grad(p: paddle.Tensor) -> np.ndarray:
            return np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy()

        gate_up = [
            np.concatenate([grad(ex.gate_proj.weight), grad(ex.up_proj.weight)], axis=1)
            for ex in self.experts
        ]
        down = [grad(ex.down_proj.weight) for ex in self.experts]
        return {"gate_up_proj": np.stack(gate_up), "down_proj": np.stack(down)}
