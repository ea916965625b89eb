"""Model FLOPs per trained token and the MFU estimate (`mfu` in metrics.jsonl).

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) is the model's own
arithmetic per second over the hardware's peak:

    mfu = flops_per_token · tokens_per_s / (hardware.peak_tflops · 1e12 · devices)

with `tokens_per_s` the whole job's tokens per second of step time (padding included) and
`devices` = dp·pp·cp. Per token:

    flops_per_token = w · N + a · L · H · d · S

* N: the weights one token multiplies in matmuls (`matmul_parameters`): every decoder
  layer's attention and MLP — for an MoE layer the router, the shared experts and the
  `num_experts_per_tok` routed experts it is sent to, not all experts — and the LM head;
  embedding lookups, norms and biases are left out;
* w = 6 (forward 2N, backward 4N: activation and weight gradients), 4 with LoRA (the frozen
  base weights get no weight gradient; the adapters are negligible), + 2 for DPO's reference
  forward pass;
* attention, L layers × H query heads × head dim d over sequences of S tokens: a = 12
  (forward QKᵀ and AV, 4·S·H·d per layer, and twice that backward), + 4 for DPO's reference
  forward. Counted as full (non-causal) attention as PaLM does: masks that skip tiles (causal,
  packed documents) make the real count smaller, so this is the conventional, comparable
  figure, not the kernel's.

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


def flops_per_token(args: Any, seq_len: int, *, lora: bool = False,
                    reference: bool = False) -> float:  # fmt: skip
    """Model FLOPs to train on one token of a `seq_len`-token sequence (module docstring);
    `lora`: frozen base weights; `reference`: plus a reference model's forward pass (DPO)."""
    weights = (4.0 if lora else 6.0) + (2.0 if reference else 0.0)
    attention = 12.0 + (4.0 if reference else 0.0)
    heads = int(args.num_layers) * int(args.num_heads) * int(args.head_size)
    return weights * matmul_parameters(args) + attention * heads * int(seq_len)


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, devices: int) -> float:
    """Model FLOPs utilisation in [0, 1] (module docstring)."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * max(devices, 1))
