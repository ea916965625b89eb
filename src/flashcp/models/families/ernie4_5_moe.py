"""ERNIE-4.5 MoE (``arch: ernie4_5_moe``; ERNIE-4.5-21B-A3B, 300B-A47B), exactly as
transformers' ``Ernie4_5_MoeForCausalLM`` computes it: ERNIE-4.5's attention (`ernie4_5`), and
on layers ``moe_layer_start_index`` ≤ i ≤ ``moe_layer_end_index`` with (i + 1) a multiple of
``moe_layer_interval`` a mixture of experts: a float32 softmax router choosing the top
``moe_k`` of ``moe_num_experts`` by softmax + a selection-only ``e_score_correction_bias``,
the chosen probabilities divided by max(their sum, ``moe_norm_min``), plus
``moe_num_shared_experts`` shared experts (one SwiGLU of that many times the expert width).

The checkpoint stores the correction bias as ``mlp.moe_statics.e_score_correction_bias``
`[1, E]` (flashcp: ``mlp.gate.e_score_correction_bias`` `[E]`). ERNIE's own keys that only
steer its training (capacity, its gate kernel, the aux-free switch, its multi-token-prediction
head, which transformers never builds: its ``mtp*`` weights are not read) are ignored with a
note. PaddleFormers (1.2.0) saves ``Ernie4_5_MoeForCausalLM`` directories in the same layout
(its fused q/k/v and gate/up split back), which read as they are.

``use_bias: true`` is refused: this class's LM head then carries a bias flashcp does not
build (every published ERNIE-4.5 MoE has ``use_bias: false``).
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.ernie4_5 import (
    ERNIE_CHECKED,
    ERNIE_DEFAULTS,
    ERNIE_FIXED,
    ERNIE_TIED,
)
from flashcp.models.families.hf import PADDLEFORMERS_IGNORED, HFSide, Reader, Rename, moe_counts
from flashcp.models.families.spec import TINY, ErrFn, Family, Preset, Router

ROUTER = Router(score="softmax", correction_bias=True, normalise="clamp", aux_loss="switch")
"""ERNIE-4.5's router (`flashcp.models.moe`)."""
ERNIE_IGNORED: dict[str, str] = {
    **PADDLEFORMERS_IGNORED,
    "moe_capacity": "ERNIE",  # token capacity of its expert-parallel training
    "moe_gate": "ERNIE",  # its gate kernel's name (top-k routing either way)
    "moe_use_aux_free": "ERNIE",  # whether its training moves the correction bias
    "num_nextn_predict_layers": "ERNIE",  # its MTP head, which transformers does not build
    "multi_token_pred_lambda": "ERNIE",  # that head's loss weight
}
"""Keys ERNIE's configs carry that transformers' class stores and never reads."""


def _read(r: Reader) -> dict[str, Any]:
    bias = r.get("use_bias")
    layers = r.get("num_hidden_layers")
    end = r.get("moe_layer_end_index")
    if end == -1 and isinstance(layers, int):  # transformers: -1 → the last layer
        end = layers - 1
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        **moe_counts(r, "moe_num_experts", "moe_k", "moe_num_shared_experts"),
        "first_k_dense_replace": r.get("moe_layer_start_index"),
        "moe_layer_end": end,
        "moe_layer_interval": r.get("moe_layer_interval"),
        "moe_norm_min": r.get("moe_norm_min"),
    }


def _write(args: ModelArgs) -> dict[str, Any]:
    end = args.num_layers - 1 if args.moe_layer_end < 0 else args.moe_layer_end
    return {
        "use_bias": args.qkv_bias,
        "moe_num_experts": args.num_experts,
        "moe_k": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "moe_num_shared_experts": args.num_shared_experts,
        "moe_layer_start_index": args.first_k_dense_replace,
        "moe_layer_end_index": end,
        "moe_layer_interval": args.moe_layer_interval,
        "moe_norm_min": args.moe_norm_min,
    }


def _check(args: ModelArgs, err: ErrFn) -> None:
    if args.qkv_bias:
        err(
            "qkv_bias",
            "use_bias true: Ernie4_5_MoeForCausalLM then biases its LM head too, which flashcp "
            "does not build; every published ERNIE-4.5 MoE has use_bias false",
        )


FAMILY = Family(
    arch="ernie4_5_moe",
    title="ERNIE-4.5 MoE, transformers' Ernie4_5_MoeForCausalLM",
    router=ROUTER,
    rotary_interleaved=True,
    fixed={**ERNIE_FIXED, "routed_scaling_factor": 1.0, "norm_topk_prob": True},
    tied=ERNIE_TIED,
    check=_check,
    presets={
        "tiny_ernie_moe": Preset(
            ModelArgs(
                arch="ernie4_5_moe", intermediate_size=128, **TINY, tie_embeddings=True,
                rotary_base=500000.0, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, num_shared_experts=2, first_k_dense_replace=1,
                moe_layer_end=1,
            ),  # fmt: skip
            False,
            "CPU tests: layer 0 dense, 4 experts top-2, 2 shared, tied embeddings",
        ),
        "ernie45_21b_a3b": Preset(
            ModelArgs(
                arch="ernie4_5_moe", vocab_size=103424, hidden_size=2560, num_layers=28,
                num_heads=20, num_kv_heads=4, head_dim=128, intermediate_size=12288,
                max_seq_len=131072,
                rotary_base=500000.0, norm_eps=1e-5, tie_embeddings=True, num_experts=64,
                num_experts_per_tok=6, moe_intermediate_size=1536, num_shared_experts=2,
                first_k_dense_replace=1, moe_layer_end=27,
            ),  # fmt: skip
            True,
            "ERNIE-4.5-21B-A3B shape; built only on GPU, validated everywhere",
        ),
    },
    hf=HFSide(
        architecture="Ernie4_5_MoeForCausalLM",
        model_type="ernie4_5_moe",
        defaults={
            **ERNIE_DEFAULTS,
            "hidden_size": 2560,
            "intermediate_size": 12288,
            "num_hidden_layers": 28,
            "num_attention_heads": 20,
            "num_key_value_heads": 4,
            "head_dim": None,  # hidden_size // num_attention_heads
            "moe_intermediate_size": 1536,
            "moe_k": 6,
            "moe_num_experts": 64,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": -1,
            "moe_layer_interval": 1,
            "moe_norm_min": 1e-12,
        },
        read=_read,
        write=_write,
        keys=frozenset({
            "use_bias", "moe_intermediate_size", "moe_k", "moe_num_experts",
            "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
            "moe_layer_interval", "moe_norm_min",
        }),  # fmt: skip
        fields={
            "qkv_bias": "use_bias",
            "o_bias": "use_bias",
            "mlp_bias": "use_bias",
            "num_experts": "moe_num_experts",
            "num_experts_per_tok": "moe_k",
            "moe_intermediate_size": "moe_intermediate_size",
            "num_shared_experts": "moe_num_shared_experts",
            "first_k_dense_replace": "moe_layer_start_index",
            "moe_layer_end": "moe_layer_end_index",
            "moe_layer_interval": "moe_layer_interval",
            "moe_norm_min": "moe_norm_min",
        },
        ignored=ERNIE_IGNORED,
        checked=ERNIE_CHECKED,
        renames=(
            Rename(
                "mlp.gate.e_score_correction_bias",
                "mlp.moe_statics.e_score_correction_bias",
                lambda shape: [1, *shape],
            ),
        ),
        unread=(r"mtp",),
    ),
)
