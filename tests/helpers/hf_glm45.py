"""GLM-4.5-shaped Hugging Face checkpoints written by hand: random tensors under the names and
`[out, in]` shapes of transformers' ``Glm4MoeForCausalLM`` plus its multi-token-prediction
(MTP) layers as GLM-4.5 ships them (``model.layers.{num_hidden_layers + d}``: ``embed_tokens``,
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and a decoder
block), from the HF module definitions — not from flashcp's own names — so a flashcp load or
export is checked against a layout it did not write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from flashcp.models import ModelArgs

MTP_PARTS = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
"""An MTP layer's tensors beside its decoder block (each ``.weight``)."""


def layer_shapes(args: ModelArgs, i: int) -> dict[str, list[int]]:
    """HF key → shape of ``Glm4MoeForCausalLM``'s decoder layer `i` (QK-norm and q/k/v biases
    as `args` says; dense below ``first_k_dense_replace``, else router + experts + shared)."""
    h, hd, m = args.hidden_size, args.head_size, args.moe_intermediate_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
    for name, rows in (("q", q), ("k", kv), ("v", kv)):
        out[p + f"self_attn.{name}_proj.weight"] = [rows, h]
        if args.qkv_bias:
            out[p + f"self_attn.{name}_proj.bias"] = [rows]
    out[p + "self_attn.o_proj.weight"] = [h, q]
    if args.use_qk_norm:
        out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = [hd]
    if i < args.first_k_dense_replace:
        mlps = [("mlp.", args.intermediate_size)]
    else:
        out[p + "mlp.gate.weight"] = [args.num_experts, h]
        out[p + "mlp.gate.e_score_correction_bias"] = [args.num_experts]
        mlps = [(f"mlp.experts.{e}.", m) for e in range(args.num_experts)]
        mlps.append(("mlp.shared_experts.", m * args.num_shared_experts))
    for prefix, width in mlps:
        out[p + prefix + "gate_proj.weight"] = [width, h]
        out[p + prefix + "up_proj.weight"] = [width, h]
        out[p + prefix + "down_proj.weight"] = [h, width]
    return out


def checkpoint_shapes(args: ModelArgs) -> dict[str, list[int]]:
    """Every HF key → shape of a GLM-4.5 checkpoint with `args.mtp_layers` MTP layers."""
    h, v = args.hidden_size, args.vocab_size
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    if not args.tie_embeddings:
        shapes["lm_head.weight"] = [v, h]
    for i in range(args.num_layers + args.mtp_layers):
        shapes.update(layer_shapes(args, i))
    for i in range(args.num_layers, args.num_layers + args.mtp_layers):
        p = f"model.layers.{i}."
        parts = ([v, h], [h], [h], [h, 2 * h], [h], [v, h])
        shapes.update({f"{p}{name}.weight": s for name, s in zip(MTP_PARTS, parts, strict=True)})
    return shapes


def random_checkpoint(
    args: ModelArgs, seed: int = 0, dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """Random tensors for `checkpoint_shapes(args)` (norms near 1) in `dtype` (float32 or
    bfloat16, as `ml_dtypes` arrays); the router's ``e_score_correction_bias`` stays float32,
    as GLM-4.5's bf16 checkpoints store it."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in checkpoint_shapes(args).items():
        value = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        value = value + np.float32(1.0) if "norm" in key else value
        if dtype == "bfloat16" and not key.endswith("e_score_correction_bias"):
            value = value.astype(ml_dtypes.bfloat16)
        out[key] = value
    return out


def hf_config_json(args: ModelArgs, **extra: Any) -> dict[str, Any]:
    """The config.json transformers 5.x writes for `args` (GLM-4.5 keys, by hand)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_size, "max_position_embeddings": args.max_seq_len,
        "attention_bias": args.qkv_bias, "use_qk_norm": args.use_qk_norm,
        "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rotary_base,
                            "partial_rotary_factor": args.partial_rotary_factor},
        "n_routed_experts": args.num_experts, "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "n_shared_experts": args.num_shared_experts,
        "first_k_dense_replace": args.first_k_dense_replace,
        "routed_scaling_factor": args.routed_scaling_factor,
        "norm_topk_prob": args.norm_topk_prob, "n_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": args.mtp_layers, "hidden_act": "silu",
        "dtype": "float32", "transformers_version": "5.3.0", **extra,
    }  # fmt: skip


def write_checkpoint(
    directory: Path,
    weights: dict[str, np.ndarray],
    *,
    shards: int = 2,
    config: dict[str, Any] | None = None,
) -> Path:
    """`weights` as an HF directory: `shards` files + index (the MTP layers in the last, as
    GLM-4.5's index puts them), and `config` as config.json when given."""
    directory.mkdir(parents=True, exist_ok=True)
    mtp = f"model.layers.{config['num_hidden_layers']}." if config else None
    keys = sorted(weights, key=lambda k: (mtp is not None and k.startswith(mtp), k))
    size = -(-len(keys) // shards)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[s * size : (s + 1) * size]
        save_file({k: weights[k] for k in part}, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
