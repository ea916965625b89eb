"""The work model: what training on one row of a batch costs, in model FLOPs.

One place for the numbers the data balancer (`flashcp.data.balance`), the balance metrics and
the MFU figure (`flashcp.metrics.flops`) use:

    flops(row) = linear_per_token · tokens + attention_per_pair · pairs

* `linear_per_token` = w · N: N the weights one token multiplies in matmuls
  (`matmul_parameters`), w = 6 (forward 2N, backward 4N), 4 with LoRA (the frozen base
  weights get no weight gradient), + 2 for DPO's reference forward pass;
* `attention_per_pair` = a · L · H · d for every (query, key) pair the mask leaves visible,
  L layers (the trained MTP depths included) × H query heads × head dim d: a = 12 (forward
  QKᵀ and AV, 4·H·d per pair and layer, and twice that backward), + 4 for DPO's reference
  forward pass.

`pairs` comes from the row's actual mask: `mask_pairs` counts them from any FlashMask in
O(S), and `document_pairs` (causal, sliding-window, global + window and prefix-LM documents:
the run's `attention.mask`) / `share_question_pairs` (DPO examples) give the same count from
the segment lengths the data pipeline lays out, which is what the balancer needs before a row
exists. Per token (`flops_per_token`), the MFU convention counts
full attention instead (every token against all S keys), as PaLM does, and the planner's
step-time estimate what a causal mask computes (`flashcp.metrics.flops`).
The kernel computes whole 128 × 128 tiles, so a document much shorter than a tile costs it a
little more than its pairs; for the document lengths worth balancing the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flashcp.mask_indices import as_numpy, to_noncausal
from flashcp.masks import DocumentMasking

LINEAR_TRAIN = 6.0
"""Matmul FLOPs per weight and token of a trained step: forward 2, backward 4."""
LINEAR_LORA = 4.0
"""The same with frozen base weights (no weight gradient)."""
LINEAR_REFERENCE = 2.0
"""Added by a reference model's forward pass (DPO)."""
ATTENTION_TRAIN = 12.0
"""Attention FLOPs per (query, key) pair, head dim and layer of a trained step."""
ATTENTION_REFERENCE = 4.0
"""Added by a reference model's forward pass (DPO)."""


def matmul_parameters(args: Any) -> int:
    """N: the weights one token multiplies in matmuls, for `flashcp.models.ModelArgs` `args` —
    its family's count (`ModelArgs.matmul_weights`, `flashcp.models.families.inventory`):
    every decoder layer's attention and MLP (for an MoE layer the router, the shared experts
    and the `num_experts_per_tok` routed experts a token is sent to) and the LM head; trained
    multi-token-prediction layers add one such layer, their eh_proj and head per depth."""
    return int(args.matmul_weights())


def trained_mtp_depths(args: Any) -> int:
    """The multi-token-prediction depths a step runs: `model.mtp_layers` when trained
    (`mtp_loss_weight` > 0), else 0 (frozen MTP layers are carried, never run)."""
    return int(getattr(args, "mtp_layers", 0)) if getattr(args, "mtp_trained", False) else 0


@dataclass(frozen=True)
class WorkModel:
    """Model FLOPs per token (linear layers) and per visible attention pair (module docstring)."""

    linear_per_token: float
    attention_per_pair: float

    @classmethod
    def for_model(cls, args: Any, *, lora: bool = False, reference: bool = False) -> WorkModel:
        """The coefficients of `args`' widths; `lora`: frozen base weights; `reference`: plus a
        reference model's forward pass (DPO)."""
        weights = (LINEAR_LORA if lora else LINEAR_TRAIN) + (LINEAR_REFERENCE if reference else 0.0)
        attention = ATTENTION_TRAIN + (ATTENTION_REFERENCE if reference else 0.0)
        layers = int(args.num_layers) + trained_mtp_depths(args)
        heads = layers * int(args.num_heads) * int(args.head_size)
        return cls(weights * matmul_parameters(args), attention * heads)

    def flops(self, tokens: Any, pairs: Any) -> Any:
        """FLOPs of rows of `tokens` tokens (padding included) and `pairs` visible pairs."""
        return self.linear_per_token * np.asarray(tokens, dtype=np.float64) + (
            self.attention_per_pair * np.asarray(pairs, dtype=np.float64)
        )

    def flops_per_token(self, keys: float) -> float:
        """Per token attending `keys` keys on average (`seq_len` for full attention, the MFU
        convention; `flashcp.metrics.flops`)."""
        return self.linear_per_token + self.attention_per_pair * keys


def causal_pairs(length: Any) -> Any:
    """Visible pairs of causal documents of `length` tokens: n(n + 1) / 2 each (int64)."""
    n = np.asarray(length, dtype=np.int64)
    return n * (n + 1) // 2


def _capped(n: Any, cap: Any) -> Any:
    """Σ_{i<n} min(i + 1, cap): keys of n rows that each see at most `cap` (int64)."""
    n, cap = np.asarray(n, dtype=np.int64), np.asarray(cap, dtype=np.int64)
    m = np.minimum(n, cap)
    return m * (m + 1) // 2 + (n - m) * cap


def window_pairs(length: Any, window: Any, global_tokens: Any = 0) -> Any:
    """Visible pairs of documents of `length` tokens under a causal sliding window of `window`
    keys (`flashcp.masks.sliding_window_document_mask`): row i sees min(i + 1, window) keys,
    and of the first `global_tokens` g those the window left behind, min(g, i - window + 1)
    (int64)."""
    n = np.asarray(length, dtype=np.int64)
    behind = np.maximum(n - np.asarray(window, dtype=np.int64), 0)
    return _capped(n, window) + _capped(behind, global_tokens)


def prefix_pairs(length: Any, prefix: Any) -> Any:
    """Visible pairs of prefix-LM documents of `length` tokens whose first `prefix` see each
    other both ways (`flashcp.masks.prefix_lm_document_mask`): p² + the causal rest (int64)."""
    n = np.asarray(length, dtype=np.int64)
    p = np.minimum(np.asarray(prefix, dtype=np.int64), n)
    return p * p + causal_pairs(n) - causal_pairs(p)


def document_pairs(masking: DocumentMasking, length: Any, prefix: Any = 0) -> Any:
    """Visible pairs of documents of `length` tokens under `masking` (the run's
    `attention.mask`), prefix_lm with `prefix`-token prefixes (int64)."""
    if masking.windowed:
        extra = masking.global_tokens if masking.kind == "global_window" else 0
        return window_pairs(length, int(masking.window or 0), extra)
    if masking.uses_prefixes:
        return prefix_pairs(length, prefix)
    return causal_pairs(length)


def share_question_pairs(prompt: Any, chosen: Any, rejected: Any) -> Any:
    """Visible pairs of DPO share-question segments `(prompt, chosen, rejected)` (the lengths
    `flashcp.masks.share_question_mask` takes): the prompt causal, each answer seeing the
    prompt and itself causally, never the other answer (int64)."""
    p, c, r = (np.asarray(x, dtype=np.int64) for x in (prompt, chosen, rejected))
    return causal_pairs(p) + (c + r) * p + causal_pairs(c) + causal_pairs(r)


def mask_pairs(indices: Any, *, causal: bool) -> np.ndarray:
    """Visible (query, key) pairs of each batch row of a FlashMask `[B, Hm, S, C]` (column j's
    masked row ranges), float64 `[B]`: counted column by column, averaged over the mask heads
    (each serves an equal share of the query heads). Never builds an S × S array."""
    idx = to_noncausal(as_numpy(indices), causal=causal).astype(np.int64)
    seq = idx.shape[2]
    if idx.shape[-1] == 2:  # [LTS, UTE]: rows [LTS, S) and [0, UTE) of column j are masked
        masked = (seq - idx[..., 0]) + idx[..., 1]
    else:  # [LTS, LTE, UTS, UTE]
        masked = (idx[..., 1] - idx[..., 0]) + (idx[..., 3] - idx[..., 2])
    return (seq - masked).sum(axis=-1).mean(axis=-1).astype(np.float64)
