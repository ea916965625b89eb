"""Model FLOPs per trained token and the MFU estimate (`mfu` in metrics.jsonl).

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) is the model's own
arithmetic per second over the hardware's peak:

    mfu = flops_per_token · tokens_per_s / (hardware.peak_tflops · 1e12 · devices)

with `tokens_per_s` the whole job's tokens per second of step time (padding included) and
`devices` = dp·pp·cp. Per token:

    flops_per_token = w · N + a · L · H · d · K

* N: the weights one token multiplies in matmuls (`matmul_parameters`): every decoder
  layer's attention and MLP — for an MoE layer the router, the shared experts and the
  `num_experts_per_tok` routed experts it is sent to, not all experts — and the LM head;
  embedding lookups, norms and biases are left out;
* w = 6 (forward 2N, backward 4N: activation and weight gradients), 4 with LoRA (the frozen
  base weights get no weight gradient; the adapters are negligible), + 2 for DPO's reference
  forward pass;
* attention, L layers × H query heads × head dim d, each query attending K keys: a = 12
  (forward QKᵀ and AV, 4·K·H·d per layer, and twice that backward), + 4 for DPO's reference
  forward. The `mfu` metric counts full (non-causal) attention, K = S, as PaLM does: the
  conventional, comparable figure. The memory plan's step-time estimate counts what a causal
  mask computes, K = (S + 1) / 2 on average (`causal_keys`): at millions of tokens attention
  dominates and the full count would double the estimate. Packed documents attend fewer
  keys still (`attended_keys` counts any FlashMask mask exactly).

Recomputed activations (`model.recompute`) are not model FLOPs and are not counted (that
would be hardware FLOPs utilisation).
"""

from __future__ import annotations

from typing import Any


def matmul_parameters(args: Any) -> int:
    """N of the module docstring for `flashcp.models.ModelArgs` `args`."""
    h, d = int(args.hidden_size), int(args.head_size)
    q, kv = int(args.num_heads) * d, int(args.num_kv_heads) * d
    attention = h * (q + 2 * kv) + q * h
    dense = (2 if args.arch == "gpt" else 3) * h * int(args.intermediate_size)
    total = 0
    for layer in range(int(args.num_layers)):
        if args.is_moe_layer(layer):
            active = int(args.num_experts_per_tok) + int(args.num_shared_experts)
            mlp = active * 3 * h * int(args.moe_intermediate_size) + h * int(args.num_experts)
        else:
            mlp = dense
        total += attention + mlp
    return total + int(args.vocab_size) * h


def flops_per_token(args: Any, seq_len: int, *, lora: bool = False, reference: bool = False,
                    keys: float | None = None) -> float:  # fmt: skip
    """Model FLOPs to train on one token of a `seq_len`-token sequence (module docstring);
    `lora`: frozen base weights; `reference`: plus a reference model's forward pass (DPO);
    `keys`: keys each query attends on average, K (default `seq_len`: full attention, the
    `mfu` convention; `causal_keys(seq_len)` for a causal mask)."""
    weights = (4.0 if lora else 6.0) + (2.0 if reference else 0.0)
    attention = 12.0 + (4.0 if reference else 0.0)
    heads = int(args.num_layers) * int(args.num_heads) * int(args.head_size)
    attended = float(seq_len) if keys is None else float(keys)
    return weights * matmul_parameters(args) + attention * heads * attended


def causal_keys(seq_len: int) -> float:
    """Keys a query attends on average under a causal mask over `seq_len` tokens: (S + 1) / 2
    (query i attends i + 1 keys)."""
    return (int(seq_len) + 1) / 2


def attended_keys(startend_row_indices: Any, causal: bool) -> float:
    """Keys a query attends on average under a FlashMask mask (`flashcp.masks`: int32
    `[B, Hm, S, C]`, column j's masked row ranges), counted exactly column by column: the
    mean over batch rows and mask heads of the unmasked (query, key) pairs per query."""
    import numpy as np

    from flashcp.masks import as_numpy, to_noncausal

    idx = to_noncausal(as_numpy(startend_row_indices), causal=causal).astype(np.int64)
    seq = idx.shape[2]
    if idx.shape[-1] == 2:  # [LTS, UTE]: rows [LTS, S) and [0, UTE) of column j are masked
        masked = (seq - idx[..., 0]) + idx[..., 1]
    else:  # [LTS, LTE, UTS, UTE]
        masked = (idx[..., 1] - idx[..., 0]) + (idx[..., 3] - idx[..., 2])
    return float((seq - masked).sum(axis=-1).mean() / seq)


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, devices: int) -> float:
    """Model FLOPs utilisation in [0, 1] (module docstring)."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * max(devices, 1))
