"""Model FLOPs per trained token and the MFU estimate (`mfu` in metrics.jsonl).

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) is the model's own
arithmetic per second over the hardware's peak:

    mfu = flops_per_token · tokens_per_s / (hardware.peak_tflops · 1e12 · devices)

with `tokens_per_s` the whole job's tokens per second of step time (padding included) and
`devices` = dp·pp·cp. Per token:

    flops_per_token = w · N + a · L · H · d · K

the coefficients of the one work model (`flashcp.cp.work.WorkModel`: N the weights a token
multiplies in matmuls, counted by the model's family, `ModelArgs.matmul_weights`; w = 6, 4 with
LoRA, + 2 for DPO's reference forward; a = 12, + 4 for DPO's reference forward), each query
attending K keys; trained multi-token-prediction layers (`model.mtp_loss_weight` > 0) are D more
layers in L and add their eh_proj and head to N
(`flashcp.models.families.inventory.trained_mtp_depths`). The `mfu` metric counts full (non-causal)
attention, K = S, as PaLM does: the conventional, comparable figure. The memory plan's step-time
estimate counts what the run's mask computes over one S-token document (`document_keys`): K = (S +
1) / 2 for the default causal mask (`causal_keys`), about the window under a sliding window; at
millions of tokens attention dominates and the full count would double the estimate. Packed
documents attend fewer keys still: the data balancer and the `balance/...` metrics count a row's
visible pairs from its segments (`flashcp.cp.work.document_pairs`, equal to `mask_pairs` of its
mask) with the same coefficients.

Recomputed activations (`model.recompute`) are not model FLOPs and are not counted (that
would be hardware FLOPs utilisation).
"""

from __future__ import annotations

from typing import Any

from flashcp.cp.work import WorkModel, causal_pairs, document_pairs
from flashcp.masks import DocumentMasking


def flops_per_token(args: Any, seq_len: int, *, lora: bool = False, reference: bool = False,
                    keys: float | None = None) -> float:  # fmt: skip
    """Model FLOPs to train on one token of a `seq_len`-token sequence (module docstring);
    `lora`: frozen base weights; `reference`: plus a reference model's forward pass (DPO);
    `keys`: keys each query attends on average, K (default `seq_len`: full attention, the
    `mfu` convention; `causal_keys(seq_len)` for a causal mask)."""
    model = WorkModel.for_model(args, lora=lora, reference=reference)
    return model.flops_per_token(float(seq_len) if keys is None else float(keys))


def causal_keys(seq_len: int) -> float:
    """Keys a query attends on average under a causal mask over `seq_len` tokens: (S + 1) / 2,
    the mask's visible pairs (`causal_pairs`) per query."""
    return float(causal_pairs(seq_len)) / int(seq_len)


def document_keys(masking: DocumentMasking, seq_len: int, prefix: int = 0) -> float:
    """Keys a query attends on average in one `seq_len`-token document under `masking` (the
    run's `attention.mask`; prefix_lm with a `prefix`-token prefix): its visible pairs
    (`document_pairs`) per query — `causal_keys` for the default causal mask, about the window
    for a sliding window much shorter than the sequence."""
    return float(document_pairs(masking, seq_len, prefix)) / int(seq_len)


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, devices: int) -> float:
    """Model FLOPs utilisation in [0, 1] (module docstring)."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * max(devices, 1))
