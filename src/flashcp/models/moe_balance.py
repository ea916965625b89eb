"""Router load balancing: DeepSeek-V3's bias update and its sequence-wise balance loss.

**Auxiliary-loss-free bias update** (DeepSeek-V3 technical report, arXiv:2412.19437, §2.1.2:
"at the end of each step, we will decrease the bias term by γ if its corresponding expert is
overloaded, and increase it by γ if its corresponding expert is underloaded, where γ is a
hyper-parameter called bias update speed"; GLM-4.5 trains with the same scheme). flashcp's
exact rule, per MoE layer, after each optimizer step that was applied::

    b_i  <-  b_i + γ · sign(c̄ - c_i)

with `c_i` the number of (token, choice) entries the router sent to expert `i` during the
step — every micro-batch, summed over every rank that sees different tokens (dp and cp) — and
`c̄ = mean_i c_i`; `sign(0) = 0`, so an exactly average expert keeps its bias. The bias only
steers selection (`flashcp.models.moe.TopkRouter`), never the weights. γ is
`model.router_bias_update_rate` (0, the default, turns it off: right for LoRA / DPO, where the
router is frozen). `update_bias` applies it; the trainer gathers the loads
(`flashcp.metrics.moe_stats`).

**Complementary sequence-wise balance loss** (same report, eqs. 17-20), per MoE layer and
training sequence (one row of the batch)::

    L_bal = α · Σ_i f_i · P_i,
    f_i = E / (k · T) · Σ_t 1[expert i ∈ top-k(t)],    P_i = 1/T · Σ_t s'_{i,t},
    s'_{i,t} = s_{i,t} / Σ_j s_{j,t}

over the sequence's `T` tokens (`s` the sigmoid affinities, `E` routed experts, `k` per
token); `f` carries no gradient. Under context parallelism a sequence's tokens are spread
over the cp ranks, so each rank all-reduces its per-row partial counts, affinity sums and token
counts over the cp group (one all-reduce per layer and micro-batch, in the forward pass) and
gets the sequence's exact `f` and `P`. As `L_bal` is linear in the affinity sums given `f`,
each rank's gradient is that of ``α · Σ_i f_i · (its own affinity sum)_i / T`` — exactly its
tokens' share — with no backward communication. The loss of a micro-batch is the mean over
its rows, scaled by `loss_scale()` (the trainer sets 1 / (micro-batches · dp), so a step's
balance loss is the mean over all its sequences); `α` is `model.router_aux_loss_coef`
(0 = off). The layer does not return the loss: `add_loss_gradient` attaches its gradient to
the layer's output (the DeepSeek-MoE "AddAuxiliaryLoss" construction), so it flows under
pipeline parallelism and recompute without touching the recipes' losses; its value is
reported as a step statistic (`moe/aux_loss`).

**Switch load-balancing loss** (Switch Transformer, Fedus et al. 2022, eq. 4; GShard), the
auxiliary loss of transformers' ``Qwen3MoeForCausalLM`` and ``Ernie4_5_MoeForCausalLM``
(``load_balancing_loss_func``, with ``router_aux_loss_coef``), per MoE layer and micro-batch::

    L_switch = α · E · Σ_i (c_i / T) · P_i,    P_i = 1/T · Σ_t p_{i,t}

over the micro-batch's `T` tokens (every row, every cp rank: the same all-reduce), `c_i` the
(token, choice) entries routed to expert i and `p` the softmax probabilities. flashcp takes
the mean of the layers' losses (`layers`: the model's MoE layers); transformers computes one
loss over all layers' tokens concatenated (the same value when every layer routes alike, and
for one MoE layer), and its 5.3 Qwen3-MoE class applies that softmax to the router's
probabilities a second time (its recorded "router_logits" are already softmaxed): flashcp
uses the probabilities once, as the formula and transformers' ERNIE-4.5 class do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from flashcp.distributed import all_reduce_tensor

_local = threading.local()


@contextlib.contextmanager
def loss_scale_context(scale: float) -> Iterator[None]:
    """Multiply every sequence-balance loss inside the block by `scale` (the trainer: one over
    the step's micro-batches × dp ranks)."""
    previous = loss_scale()
    _local.scale = float(scale)
    try:
        yield
    finally:
        _local.scale = previous


def loss_scale() -> float:
    """The current scale of the sequence-balance loss (1 outside `loss_scale_context`)."""
    return float(getattr(_local, "scale", 1.0))


def balance_loss(
    kind: str,
    scores: paddle.Tensor,
    ids: paddle.Tensor,
    coef: float,
    group: Any = None,
    *,
    layers: int = 1,
) -> paddle.Tensor:
    """This rank's part of the micro-batch's balance loss of the router's `kind` (``sequence``:
    `sequence_balance_loss`; ``switch``: `switch_balance_loss`, a mean over `layers`)."""
    if kind == "switch":
        return switch_balance_loss(scores, ids, coef, group) / max(int(layers), 1)
    return sequence_balance_loss(scores, ids, coef, group)


def switch_balance_loss(
    scores: paddle.Tensor, ids: paddle.Tensor, coef: float, group: Any = None
) -> paddle.Tensor:
    """This rank's part of one layer's Switch loss over the whole micro-batch (a scalar with
    gradient through `scores`; summed over the cp ranks it is the loss): `scores` `[B, L, E]`
    float32 softmax probabilities, `ids` `[B, L, k]` chosen experts, `group` the cp group."""
    experts = int(scores.shape[-1])
    flat = scores.reshape([-1, experts])
    probability = flat.sum(axis=0, keepdim=True)  # [1, E], this rank's tokens, with gradient
    chosen = F.one_hot(ids.reshape([-1]), experts).sum(axis=0, keepdim=True)  # [1, E]
    stats = paddle.concat(
        [chosen.astype("float32"), paddle.full([1, 1], float(flat.shape[0]), dtype="float32")],
        axis=1,
    )
    if group is not None and int(group.nranks) > 1:
        stats = all_reduce_tensor(stats, group)
    counts, tokens = stats[:, :experts], stats[:, experts:]
    f = counts / tokens  # [1, E], no gradient
    share = (f * probability / tokens).sum()  # this rank's share of Σ f·P
    return share * (float(coef) * experts * loss_scale())


def sequence_balance_loss(
    scores: paddle.Tensor, ids: paddle.Tensor, coef: float, group: Any = None
) -> paddle.Tensor:
    """This rank's part of the micro-batch's balance loss (a scalar with gradient through
    `scores`; summed over the cp ranks it is the loss): `scores` `[B, L, E]` float32 sigmoid
    affinities, `ids` `[B, L, k]` chosen experts, `group` the cp group (None: whole rows)."""
    rows, length, experts = (int(s) for s in scores.shape)
    top_k = int(ids.shape[-1])
    share = scores / scores.sum(axis=-1, keepdim=True)
    affinity = share.sum(axis=1)  # [B, E], this rank's tokens, with gradient
    chosen = F.one_hot(ids.reshape([rows, -1]), experts).sum(axis=1)  # [B, E]
    stats = paddle.concat(
        [
            chosen.astype("float32"),
            affinity.detach(),
            paddle.full([rows, 1], float(length), dtype="float32"),
        ],
        axis=1,
    )
    if group is not None and int(group.nranks) > 1:
        stats = all_reduce_tensor(stats, group)
    counts, tokens = stats[:, :experts], stats[:, 2 * experts :]
    f = counts * (experts / top_k) / tokens  # [B, E], no gradient
    per_row = (f * affinity / tokens).sum(axis=1)  # this rank's share of each row's Σ f·P
    return per_row.mean() * (float(coef) * loss_scale())


class _AddLossGradient(PyLayer):
    """Identity on `out`; backward also gives `loss` the gradient 1 (its own loss term)."""

    @staticmethod
    def forward(ctx, out, loss):  # type: ignore[no-untyped-def, override]
        ctx.shape, ctx.dtype = loss.shape, loss.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad, paddle.ones(ctx.shape, dtype=ctx.dtype)


def add_loss_gradient(out: paddle.Tensor, loss: paddle.Tensor) -> paddle.Tensor:
    """`out` unchanged, with `loss` added to the objective its backward pass differentiates."""
    return _AddLossGradient.apply(out, loss)


def bias_step(load: np.ndarray, rate: float) -> np.ndarray:
    """The bias change of one layer for the step's expert load `load` `[E]`:
    ``rate · sign(mean(load) - load)`` (float32)."""
    load = np.asarray(load, dtype=np.float64)
    return (np.float32(rate) * np.sign(load.mean() - load)).astype(np.float32)


@paddle.no_grad()
def update_bias(bias: paddle.Tensor, load: np.ndarray, rate: float) -> None:
    """Apply `bias_step` to a router's `e_score_correction_bias` in place."""
    step = paddle.to_tensor(bias_step(load, rate), place=bias.place)
    paddle.assign(bias + step, output=bias)
