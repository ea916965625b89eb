"""The routed part of a `flashcp.models.moe.MoE` written from its definition in float64 numpy —
the tests' reference for the gradients through the dispatch and the combine (the per-expert
loop, `bench.moe_loop.LoopMoE`, does not model capacity).

`routed_reference(moe, x, probe, capacity)`: routing, capacity drops in token order, the
weighted sum, and the gradients of ``Σ probe · out`` with respect to the routing weights, the
router's weight and the input tokens.

`kept_rows(ids, num_experts, capacity)` / `permute_reference(x, ...)`: the expert-sorted buffer
of a dispatch with drops from the same definition, as a plain (differentiable) Paddle gather of
the kept tokens: autograd's own backward of the permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn


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
    x_grad: np.ndarray
    """`[T, H]`: d loss / d tokens, through the kept entries' experts and the router."""
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
    a, b = h[..., :inter], h[..., inter:]
    act = a * _sigmoid(a) * b  # SwiGLU: silu(a) · b
    y = np.einsum("tei,eih->teh", act, down)  # every expert on every token
    used = np.where(keep, weights, 0.0)
    out = np.einsum("te,teh->th", used, y)
    weight_grad = np.where(keep, np.einsum("teh,th->te", y, probe64), 0.0)
    if gate.norm_topk_prob:  # w_e = scale · s_e / Σ s  →  dL/ds_e = scale (g_e − Σ g·w/scale) / Σ s
        inner = (weight_grad * raw).sum(axis=-1, keepdims=True) / total
        score_grad = np.where(chosen, scale * (weight_grad - inner) / total, 0.0)
    else:
        score_grad = np.where(chosen, scale * weight_grad, 0.0)
    logit_grad = score_grad * scores * (1.0 - scores)
    router_grad = x64.T @ logit_grad
    # through the experts: d/dx of Σ_e used[t, e] · probe[t] · y[t, e] (a dropped entry: 0)
    act_grad = np.einsum("th,eih->tei", probe64, down) * used[..., None]
    silu_grad = _sigmoid(a) * (1.0 + a * (1.0 - _sigmoid(a)))
    h_grad = np.concatenate([act_grad * b * silu_grad, act_grad * a * _sigmoid(a)], axis=-1)
    x_grad = np.einsum("tei,ehi->th", h_grad, gate_up) + logit_grad @ w_gate.T
    return RoutedReference(out, chosen, keep, weight_grad, router_grad, x_grad, float(gaps.min()))


def kept_rows(ids: np.ndarray, num_experts: int, capacity: int | None) -> np.ndarray:
    """The token of every row of the expert-sorted buffer: expert by expert, its entries in
    token order, the first `capacity` of them kept (None: all)."""
    rows: list[int] = []
    for e in range(num_experts):
        tokens = [t for t in range(ids.shape[0]) for choice in ids[t] if choice == e]
        rows += tokens if capacity is None else tokens[:capacity]
    return np.asarray(rows, dtype=np.int64)


def permute_reference(
    x: paddle.Tensor, ids: np.ndarray, num_experts: int, capacity: int | None
) -> paddle.Tensor:
    """The buffer `[rows, H]` of tokens `x` `[T, H]`, by a plain `paddle.gather` of the kept
    tokens (`kept_rows`): its gradient is Paddle's own, each token's kept rows summed and a
    fully dropped token's zero."""
    return paddle.gather(x, paddle.to_tensor(kept_rows(ids, num_experts, capacity)), axis=0)
