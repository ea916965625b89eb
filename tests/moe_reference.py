"""The per-expert loop MoE — flashcp's MoE before grouped expert compute — kept as the independent
reference for the grouped path (tests) and the baseline of `scripts/bench_moe.py`.

`LoopMoE(moe)` holds the same weights as a grouped `flashcp.models.moe.MoE` in the OLD layout —
one `SwiGLU` (separate `gate_proj` / `up_proj` / `down_proj` Linears) per routed expert, copied
from the stacked slices — and shares its router and shared experts. Its forward is the old
loop: for every expert in index order find its tokens (`nonzero`, a host sync), gather them
(`index_select`), run the expert, weight the outputs and add them back (`index_add`) into a
float32 accumulator. `stacked_grads` puts the per-expert gradients back in the stacked layout
for comparison.

`routed_reference(moe, x, probe, capacity)` is the routed part of the same layer written from its
definition in float64 numpy — routing, capacity drops in token order, the weighted sum, and the
gradients of ``Σ probe · out`` with respect to the routing weights and the router's weight —
the reference for the gradients through the combine (which the loop does not model: it has no
capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class RoutedReference:
    """`routed_reference`'s results; `[T, E]` arrays are indexed by token and GLOBAL expert."""

    out: np.ndarray
    """`[T, H]`: the routed sum (no shared experts)."""
    chosen: np.ndarray
    """`[T, E]` bool: the router's top-k choice."""
    keep: np.ndarray
    """`[T, E]` bool: chosen and within its expert's capacity."""
    weight_grad: np.ndarray
    """`[T, E]`: d loss / d routing weight (0 where not chosen, and where dropped)."""
    router_grad: np.ndarray
    """`[H, E]`: d loss / d router weight (`moe.gate.weight`)."""
    margin: float
    """Smallest gap between a token's k-th and (k+1)-th choice score: the choice is only
    meaningful to compare when it is well above float32 rounding."""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def routed_reference(
    moe: nn.Layer, x: np.ndarray, probe: np.ndarray, capacity: int | None
) -> RoutedReference:
    """The routed experts of `moe` (a `flashcp.models.moe.MoE` holding every expert) on tokens
    `x` `[T, H]`, in float64 from the definition, with the gradients of ``loss = Σ probe · out``.

    Routing (HF Glm4Moe): ``s = sigmoid(x W)``, top-k of ``s + bias``, weights ``s`` of the
    chosen (over their sum when `norm_topk_prob`) times `routed_scaling_factor`. Capacity:
    each expert keeps its first `capacity` tokens in token order (None: all); a dropped entry
    contributes nothing, so its weight gets no gradient."""
    gate, experts = moe.gate, moe.experts
    x64, probe64 = np.asarray(x, np.float64), np.asarray(probe, np.float64)
    w_gate = gate.weight.astype("float32").numpy().astype(np.float64)
    bias = gate.e_score_correction_bias.numpy().astype(np.float64)
    tokens, num_experts, k = x64.shape[0], w_gate.shape[1], gate.top_k
    scores = _sigmoid(x64 @ w_gate)
    choice = scores + bias
    ranked = np.argsort(-choice, axis=-1, kind="stable")
    ranked_scores = np.take_along_axis(choice, ranked, axis=-1)
    gaps = ranked_scores[:, k - 1] - ranked_scores[:, k] if k < num_experts else np.ones(1)
    chosen = np.zeros((tokens, num_experts), dtype=bool)
    np.put_along_axis(chosen, ranked[:, :k], True, axis=-1)
    keep = chosen.copy()
    if capacity is not None:
        for e in range(num_experts):
            keep[np.flatnonzero(chosen[:, e])[capacity:], e] = False
    raw = np.where(chosen, scores, 0.0)
    total = raw.sum(axis=-1, keepdims=True)
    scale = gate.routed_scaling_factor
    weights = raw / total * scale if gate.norm_topk_prob else raw * scale
    inter = experts.intermediate_size
    gate_up = experts.gate_up_proj.astype("float32").numpy().astype(np.float64)
    down = experts.down_proj.astype("float32").numpy().astype(np.float64)
    h = np.einsum("th,ehi->tei", x64, gate_up)
    act = h[..., :inter] * _sigmoid(h[..., :inter]) * h[..., inter:]
    y = np.einsum("tei,eih->teh", act, down)  # every expert on every token
    used = np.where(keep, weights, 0.0)
    out = np.einsum("te,teh->th", used, y)
    weight_grad = np.where(keep, np.einsum("teh,th->te", y, probe64), 0.0)
    if gate.norm_topk_prob:  # w_e = scale · s_e / Σ s  →  dL/ds_e = scale (g_e − Σ g·w/scale) / Σ s
        inner = (weight_grad * raw).sum(axis=-1, keepdims=True) / total
        score_grad = np.where(chosen, scale * (weight_grad - inner) / total, 0.0)
    else:
        score_grad = np.where(chosen, scale * weight_grad, 0.0)
    router_grad = x64.T @ (score_grad * scores * (1.0 - scores))
    return RoutedReference(out, chosen, keep, weight_grad, router_grad, float(gaps.min()))
