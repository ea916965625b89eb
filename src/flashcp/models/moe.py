"""Mixture of experts: a top-k router of the family's kind, grouped routed experts, shared
experts (GLM-4.5, ERNIE-4.5 MoE, Qwen3-MoE).

Routing, per token in float32, as the family's `flashcp.models.families.spec.Router` says:

1. ``scores = sigmoid(x @ W_gate)`` (GLM-4.5, HF ``Glm4MoeTopkRouter`` from DeepSeek-V3) or
   ``softmax(x @ W_gate)`` (HF ``Qwen3MoeTopKRouter``, ``Ernie4_5_MoeTopKRouter``) over the E
   routed experts (a true float32 matmul on every device: autocast and TF32 off,
   `flashcp.models.precision.float32_matmul`);
2. choose the top-k of ``scores`` plus, for routers with one, ``e_score_correction_bias`` —
   the bias (a persistent float32 buffer, no gradient) steers selection only; load balancing
   moves it between steps (`flashcp.models.moe_balance`, `model.router_bias_update_rate`);
3. weights are the RAW scores of the chosen experts, normalised (GLM-4.5: divided by their sum
   + 1e-20 when `norm_topk_prob`; Qwen3-MoE: by their sum when `norm_topk_prob`; ERNIE-4.5:
   always by max(sum, `moe_norm_min`)), then multiplied by `routed_scaling_factor`.

The layer output is ``sum_k w_k · expert_k(x) + shared_experts(x)``, the routed sum in float32.
Group-limited selection (DeepSeek-V3's ``n_group`` > ``topk_group``) is not implemented.

Expert parallelism (`parallel.ep` > 1): a rank holds only its ep rank's share of the routed
experts; between the sort and the combine the rows travel to the experts' ranks and back
(`flashcp.models.expert_parallel`). The router and the shared experts are replicated.

The routed experts run grouped: the (token, choice) entries are sorted by expert once
(`flashcp.models.moe_dispatch.build_dispatch`: one host sync per call for the counts), the
sorted tokens go through every expert together (`flashcp.models.experts.GroupedExperts`:
stacked weights, batched matmuls) in the dtype the experts compute in (`row_dtype`: bf16 for
bf16 weights on the GPU grouped GEMM, cast once before dispatch; else the activations'), and
the outputs are unpermuted and combined with the routing weights in float32
(`moe_dispatch.combine`). Deterministic; dropless unless
`model.moe_capacity_factor` > 0 (then the drops are counted).

Statistics for the trainer (`flashcp.metrics.moe_stats`): each call made while gradients are
recorded — the training forward, or the replay under activation recompute, never the no-grad
first recompute pass, DPO reference or evaluation passes — adds its per-expert load (entries
routed, before capacity), its dropped entries and its balance-loss value to the layer's
accumulators (`take_stats` reads and resets them). `last_tokens_per_expert` is the load of the
last call of any kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from flashcp.models.config import ModelArgs
from flashcp.models.expert_layout import capacity_for
from flashcp.models.expert_parallel import expert_parallel_rows
from flashcp.models.experts import GroupedExperts
from flashcp.models.families.spec import Router
from flashcp.models.init import normal_attr
from flashcp.models.layers import SwiGLU
from flashcp.models.moe_balance import add_loss_gradient, balance_loss
from flashcp.models.moe_dispatch import (
    build_dispatch,
    combine,
    permute,
    relayout,
)
from flashcp.models.precision import float32_matmul


@dataclass
class Routing:
    """One call's routing: affinities `[T, E]` (float32), choices and weights `[T, k]`."""

    scores: paddle.Tensor
    ids: paddle.Tensor
    weights: paddle.Tensor


class TopkRouter(nn.Layer):
    """The gate: weight `[hidden, E]` (Paddle orientation; HF stores `[E, hidden]`), stored in
    the parameter dtype and used in float32; the correction bias (routers with one) is a
    float32 buffer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        kind = args.family.router
        if kind is None:
            raise ValueError(f"arch {args.arch} has no router (not a MoE family)")
        self.kind: Router = kind
        self.top_k = args.num_experts_per_tok
        self.num_experts = args.num_experts
        self.norm_topk_prob = args.norm_topk_prob
        self.norm_min = float(args.moe_norm_min)
        self.routed_scaling_factor = float(args.routed_scaling_factor)
        self.weight = self.create_parameter(
            [args.hidden_size, args.num_experts],
            attr=normal_attr(args.initializer_range),
        )
        if kind.correction_bias:
            self.register_buffer(
                "e_score_correction_bias",
                paddle.zeros([args.num_experts], dtype="float32"),
                persistable=True,
            )
        else:
            self.e_score_correction_bias = None

    def route(self, x: paddle.Tensor) -> Routing:
        """`x` `[T, hidden]` → affinities, expert ids (int64) and weights (float32)."""
        # float32 on every device (autocast and TF32 off, `precision.float32_math`): expert
        # choice is sensitive to the affinities' rounding (near-ties)
        logits = float32_matmul(x, self.weight)
        kind = self.kind
        scores = F.sigmoid(logits) if kind.score == "sigmoid" else F.softmax(logits, axis=-1)
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.unsqueeze(0)
        _, ids = paddle.topk(choice, k=self.top_k, axis=-1)
        weights = paddle.take_along_axis(scores, ids, axis=-1)
        if kind.normalise == "clamp":
            weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=self.norm_min)
        elif self.norm_topk_prob and kind.normalise == "sum_eps":
            weights = weights / (weights.sum(axis=-1, keepdim=True) + 1e-20)
        elif self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdim=True)
        return Routing(scores, ids, weights * self.routed_scaling_factor)

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """`x` `[T, hidden]` → (expert ids `[T, k]` int64, weights `[T, k]` float32)."""
        routing = self.route(x)
        return routing.ids, routing.weights


@dataclass
class RoutingStats:
    """What a layer's calls under gradient recording accumulated (see the module docstring)."""

    load: np.ndarray
    """`[E]` int64: entries routed to each expert."""
    dropped: int
    """Entries dropped by the capacity."""
    aux_loss: float
    """This rank's part of the sequence-balance loss (0 when off)."""


class MoE(nn.Layer):
    """Routed experts (`GroupedExperts`) plus `num_shared_experts` shared experts fused into
    one SwiGLU.

    `experts`: the routed experts this rank holds (GLOBAL indices; default all). Under expert
    parallelism (`flashcp.models.expert_parallel`) they are ep rank `ep_rank`'s share of
    `ep_size`, and the layer exchanges tokens over `exchange` (set by
    `expert_parallel.attach_exchange` before the first call)."""

    def __init__(self, args: ModelArgs, experts: range | None = None) -> None:
        super().__init__()
        std = args.initializer_range
        held = range(args.num_experts) if experts is None else experts
        size = len(held)
        if size < 1 or args.num_experts % size or held.start % size or held.step != 1:
            raise ValueError(
                f"experts {held} are not one ep rank's share of model.num_experts="
                f"{args.num_experts} (equal contiguous blocks)"
            )
        self.ep_size = args.num_experts // size
        self.ep_rank = held.start // size
        self.exchange: Any = None
        """The ep group's `flashcp.distributed.Exchange` (ep_size > 1)."""
        self.gate = TopkRouter(args)
        self.experts = GroupedExperts(
            size,
            args.hidden_size,
            args.moe_intermediate_size,
            std=std,
            first_expert=held.start,
            total_experts=args.num_experts,
        )
        self.shared_experts: SwiGLU | None = None
        if args.num_shared_experts > 0:
            self.shared_experts = SwiGLU(
                args.hidden_size,
                args.moe_intermediate_size * args.num_shared_experts,
                fused=False,
                std=std,
            )
        self.capacity_factor = float(args.moe_capacity_factor)
        self.aux_loss_coef = float(args.router_aux_loss_coef)
        self.moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_layers))
        """The model's MoE decoder layers: a Switch balance loss is their mean."""
        self.last_tokens_per_expert: np.ndarray | None = None
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._load = np.zeros(self.gate.num_experts, dtype=np.int64)
        self._dropped = 0
        self._aux: paddle.Tensor | None = None

    def take_stats(self) -> RoutingStats:
        """The accumulated statistics (then reset)."""
        aux = 0.0 if self._aux is None else float(self._aux)
        stats = RoutingStats(self._load.copy(), self._dropped, aux)
        self._reset_stats()
        return stats

    def forward(self, x: paddle.Tensor, group: Any = None) -> paddle.Tensor:
        """`x` `[B, L, H]` (or `[T, H]`) → same shape. `group`: the cp group, over which the
        sequence-balance loss gathers its per-sequence statistics."""
        shape = x.shape
        hidden = int(shape[-1])
        flat = x.reshape([-1, hidden])
        routing = self.gate.route(flat)
        num_experts, top_k = self.gate.num_experts, self.gate.top_k
        capacity = capacity_for(self.capacity_factor, int(flat.shape[0]), top_k, num_experts)
        dispatch = build_dispatch(routing.ids, num_experts, capacity)
        # rows in the experts' compute dtype from the start (bf16 on the GPU grouped GEMM):
        # half the buffer and all-to-all bytes of float32, the same result (`experts`)
        dtype = self.experts.row_dtype(flat)
        if self.ep_size > 1:
            rows, _ = expert_parallel_rows(
                self.experts, permute(flat, dispatch, dtype), dispatch.counts, self._exchange()
            )
            out = combine(rows, dispatch, routing.weights).astype(x.dtype).reshape(shape)
        else:
            layout = self.experts.plan(dispatch.counts, flat)
            laid = relayout(dispatch, layout.row_index(), layout.rows)  # tokens to the layout
            y = self.experts(permute(flat, laid, dtype), layout)
            out = combine(y, laid, routing.weights).astype(x.dtype).reshape(shape)
            del y  # without gradients it dies before the shared expert
        self.last_tokens_per_expert = dispatch.routed
        if paddle.is_grad_enabled():
            self._load += dispatch.routed
            self._dropped += dispatch.dropped
            if self.aux_loss_coef > 0:
                out = self._balance(out, routing, shape, group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _exchange(self) -> Any:
        if self.exchange is None:
            raise RuntimeError(
                f"this MoE layer holds experts {self.experts.first_expert}.."
                f"{self.experts.first_expert + self.experts.num_experts - 1} of "
                f"{self.gate.num_experts} (ep rank {self.ep_rank} of {self.ep_size}) but has no "
                "expert-parallel group: call flashcp.models.expert_parallel.attach_exchange("
                "model, groups.ep_exchange()) first"
            )
        return self.exchange

    def _balance(self, out: paddle.Tensor, routing: Routing, shape: Any, group: Any) -> Any:
        rows = int(shape[0]) if len(shape) == 3 else 1
        experts, top_k = self.gate.num_experts, self.gate.top_k
        loss = balance_loss(
            self.gate.kind.aux_loss,
            routing.scores.reshape([rows, -1, experts]),
            routing.ids.reshape([rows, -1, top_k]),
            self.aux_loss_coef,
            group,
            layers=self.moe_layers,
        )
        value = loss.detach()
        self._aux = value if self._aux is None else self._aux + value
        return add_loss_gradient(out, loss)
