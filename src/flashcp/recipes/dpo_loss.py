"""DPO: answer log-prob sums from per-token log-probs, and the preference losses.

    hidden = model(input_ids, positions, attn)                 # final-norm hidden states
    token_lp = model.token_logprobs(hidden, labels)            # [B, L], 0 on ignored labels
    chosen, rejected = sequence_logps(token_lp, batch.spans)   # [N] each
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)

Losses, with ``h = (pi_c - pi_r) - (ref_c - ref_r)`` per example and the batch mean taken:

* ``sigmoid`` (DPO, Rafailov et al. 2023), with conservative label smoothing ``ls``:
  ``-(1 - ls) log σ(β h) - ls log σ(-β h)``;
* ``ipo`` (Azar et al. 2023): ``(h - 1 / (2β))²`` (the paper uses length-averaged log-probs:
  `sequence_logps(..., average=True)`);
* ``hinge`` (SLiC-style): ``relu(1 - β h)``.

These are the formulas of PaddleFormers' `paddleformers.nn.criterion.dpo_loss.cal_dpo_loss`
(the unit tests compare against it). Metrics: implicit rewards ``β (π - ref)`` of the chosen
and rejected answers (means), their margin and the fraction of examples where chosen wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from flashcp.attention.context import AttentionContext
from flashcp.models import DEFAULT_LOSS_CHUNK_TOKENS

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


# --------------------------------------------------------------------------- log-prob sums


def span_segments(spans: Any, shape: Sequence[int], columns: Any = None) -> np.ndarray:
    """Int64 `[B, L]`: `2 n + a` where the token's label belongs to answer `a` of example `n`,
    else -1. `columns` (`[L]` or `[B, L]`) gives the GLOBAL column of each local token (a
    context-parallel shard, e.g. `flashcp.cp.assigned_positions`); default `arange(L)`."""
    sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2, 3)
    b, length = int(shape[0]), int(shape[1])
    if columns is None:
        cols = np.broadcast_to(np.arange(length), (b, length))
    else:
        cols = np.broadcast_to(np.asarray(columns, dtype=np.int64), (b, length))
    width = int(max(cols.max(initial=0) + 1, sp[..., 2].max(initial=0)))
    full = np.full((b, width), -1, dtype=np.int64)
    for n in range(sp.shape[0]):
        for a in (0, 1):
            row, start, end = (int(v) for v in sp[n, a])
            if row < 0:
                continue  # this answer is not in the batch
            if not (0 <= row < b and 0 <= start <= end):
                raise ValueError(
                    f"span {[row, start, end]} of example {n} is outside the [{b}, ...] batch"
                )
            if (full[row, start:end] >= 0).any():
                raise ValueError(f"span {[row, start, end]} of example {n} overlaps another span")
            full[row, start:end] = 2 * n + a
    return np.take_along_axis(full, cols, axis=1)


def sequence_logps(
    token_logps: paddle.Tensor,
    spans: Any,
    *,
    columns: Any = None,
    average: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Per-example sums of `token_logps` `[B, L]` over the chosen and rejected spans.

    `spans` is `DPOBatch.spans` (`[N, 2, 3]` of (row, start, end) label columns). Returns
    float32 `[N]` tensors (chosen, rejected), differentiable w.r.t. `token_logps`; a span of an
    answer missing from the batch (row -1) sums to 0. With `columns` (the global columns of a
    CP shard's tokens) only local tokens are summed: all-reduce the results over the CP group.
    `average=True` divides by the answer lengths (IPO), which commutes with that all-reduce.
    """
    if len(token_logps.shape) != 2:
        raise ValueError(f"token_logps must be [batch, seq], got {list(token_logps.shape)}")
    sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2, 3)
    n = sp.shape[0]
    seg = span_segments(sp, token_logps.shape, columns).reshape(-1)
    picked = np.nonzero(seg >= 0)[0]
    flat = token_logps.astype("float32").reshape([-1])
    # No shortcut when no answer token is local (a cp rank whose chunks hold only prompts):
    # the empty gather keeps the sums attached to `token_logps`, so this rank's loss still
    # back-propagates through the model and runs every collective its cp peers run.
    values = paddle.gather(flat, paddle.to_tensor(picked, place=flat.place))
    index = paddle.to_tensor(seg[picked], place=flat.place)
    sums = paddle.index_add(paddle.zeros([2 * n], dtype="float32"), index, 0, values)
    sums = sums.reshape([n, 2])
    if average:
        lens = np.maximum(sp[..., 2] - sp[..., 1], 1).astype(np.float32)
        sums = sums / paddle.to_tensor(lens, place=flat.place)
    return sums[:, 0], sums[:, 1]


def answer_logps(
    model: Any,
    batch: Any,
    *,
    attn: Any = None,
    average: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(chosen, rejected) log-prob sums of a whole `DPOBatch` under `model` (no CP sharding).

    Runs `model(input_ids, positions, attn)` (final-norm hidden states) with the batch's mask
    (unless `attn` is given), then its chunked head `model.token_logprobs` over chunks of
    `chunk_tokens` answer tokens (None: the default, 0: the full logits). For reference
    log-probs wrap it in `paddle.no_grad()` and, for a LoRA policy,
    `flashcp.lora.model.disable_adapters`.
    """
    if attn is None:
        attn = AttentionContext(mask=batch.mask.indices, causal=batch.mask.causal)
    hidden = model(paddle.to_tensor(batch.input_ids), paddle.to_tensor(batch.positions), attn)
    chunk = DEFAULT_LOSS_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    token_lp = model.token_logprobs(hidden, paddle.to_tensor(batch.labels), chunk_tokens=chunk)
    return sequence_logps(token_lp, batch.spans, average=average)


# -------------------------------------------------------------------------------- the loss


def _as_vector(x: Any, name: str) -> paddle.Tensor:
    t = x if isinstance(x, paddle.Tensor) else paddle.to_tensor(np.asarray(x, dtype=np.float32))
    if len(t.shape) != 1:
        raise ValueError(f"{name} must be a 1-D [examples] tensor, got shape {list(t.shape)}")
    return t.astype("float32")


def dpo_terms(
    policy_chosen: paddle.Tensor,
    policy_rejected: paddle.Tensor,
    ref_chosen: paddle.Tensor,
    ref_rejected: paddle.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Per-example DPO loss `[N]` and the (detached) chosen / rejected rewards `[N]`.

    The trainer sums the per-example losses and divides by the GLOBAL number of examples of
    the step, so every parallel layout averages over the same set; `dpo_loss` is the mean.
    The reference log-probs are treated as constants (detached).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to the sigmoid loss only, not {loss_type!r}")
    pc = _as_vector(policy_chosen, "policy_chosen")
    pr = _as_vector(policy_rejected, "policy_rejected")
    rc = _as_vector(ref_chosen, "ref_chosen").detach()
    rr = _as_vector(ref_rejected, "ref_rejected").detach()
    shapes = {tuple(t.shape) for t in (pc, pr, rc, rr)}
    if len(shapes) != 1:
        raise ValueError(f"all four log-prob vectors must have one shape, got {sorted(shapes)}")
    h = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        per = -(1.0 - label_smoothing) * F.log_sigmoid(beta * h)
        if label_smoothing:
            per = per - label_smoothing * F.log_sigmoid(-beta * h)
    elif loss_type == "ipo":
        per = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        per = F.relu(1.0 - beta * h)
    with paddle.no_grad():
        chosen_r = beta * (pc.detach() - rc)
        rejected_r = beta * (pr.detach() - rr)
    return per, chosen_r, rejected_r


def reward_metrics(chosen_r: paddle.Tensor, rejected_r: paddle.Tensor) -> dict[str, paddle.Tensor]:
    """Means over the examples: chosen / rejected rewards, margin, accuracy (chosen wins)."""
    with paddle.no_grad():
        return {
            "rewards/chosen": chosen_r.mean(),
            "rewards/rejected": rejected_r.mean(),
            "rewards/margin": (chosen_r - rejected_r).mean(),
            "rewards/accuracy": (chosen_r > rejected_r).astype("float32").mean(),
        }


def dpo_loss(
    policy_chosen: paddle.Tensor,
    policy_rejected: paddle.Tensor,
    ref_chosen: paddle.Tensor,
    ref_rejected: paddle.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[paddle.Tensor, dict[str, paddle.Tensor]]:
    """Mean DPO loss over the examples, and detached scalar metrics.

    Inputs are per-example answer log-prob sums `[N]`; the reference ones are treated as
    constants (detached). Metrics: ``rewards/chosen``, ``rewards/rejected`` (mean
    ``β (π - ref)``), ``rewards/margin`` (their mean difference) and ``rewards/accuracy``
    (fraction with chosen reward > rejected reward).
    """
    per, chosen_r, rejected_r = dpo_terms(
        policy_chosen,
        policy_rejected,
        ref_chosen,
        ref_rejected,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
    )
    return per.mean(), reward_metrics(chosen_r, rejected_r)
