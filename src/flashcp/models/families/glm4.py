"""GLM-4 dense (``arch: glm``), exactly as transformers' ``Glm4ForCausalLM`` (GLM-4-0414)
computes it: RMSNorm, partial *interleaved* rotary (pairs (2i, 2i+1) of the first
``head_dim · partial_rotary_factor`` dims), q/k/v bias, GQA, a SwiGLU with one fused
``gate_up_proj``, and GLM-4's two extra "sandwich" norms::

    h = h + post_self_attn_layernorm(attn(input_layernorm(h)))
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

``num_nextn_predict_layers`` (which ``Glm4Config`` lacks) is read too: flashcp's own GLM-4
exports of a model with multi-token-prediction layers write it (`flashcp.models.mtp`).
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import PADDLEFORMERS_IGNORED, HFSide, Reader
from flashcp.models.families.spec import SMALL, TINY, Family, Preset

GLM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
}
"""Defaults transformers' (5.3) ``Glm4Config`` and ``Glm4MoeConfig`` share."""
GLM_SHAPE: dict[str, Any] = dict(partial_rotary_factor=0.5, qkv_bias=True)
"""What the GLM presets share: half of each head rotated, q/k/v biases."""
GLM_CHECKED: dict[str, tuple[tuple[Any, ...], str]] = {
    "scoring_func": (
        ("sigmoid",),
        "flashcp's GLM-4.5 router scores experts with a sigmoid (as GLM-4.5 and transformers' "
        "Glm4MoeForCausalLM do)",
    ),
    "topk_method": (
        ("noaux_tc",),
        "flashcp's GLM-4.5 router picks the top-k of sigmoid scores plus "
        "e_score_correction_bias (noaux_tc, as GLM-4.5 does)",
    ),
    "sliding_window": (
        (None,),
        "flashcp computes GLM-4.5 with full causal attention in every layer, as GLM-4.5 does",
    ),
}
"""Keys PaddleFormers writes into its GLM configs that change the maths: accepted at the value
flashcp computes."""


def _read(r: Reader) -> dict[str, Any]:
    return {"qkv_bias": r.get("attention_bias")}


def _write(args: ModelArgs) -> dict[str, Any]:
    return {"attention_bias": args.qkv_bias}


FAMILY = Family(
    arch="glm",
    title="GLM-4, transformers' Glm4ForCausalLM",
    fused_gate_up=True,
    sandwich_norms=True,
    rotary_interleaved=True,
    mtp=True,
    fixed={"use_qk_norm": False, "o_bias": False, "mlp_bias": False},
    presets={
        "tiny_glm": Preset(
            ModelArgs(arch="glm", intermediate_size=128, **TINY, **GLM_SHAPE), False, "CPU tests"
        ),
        "small_glm": Preset(
            ModelArgs(arch="glm", intermediate_size=704, **SMALL, **GLM_SHAPE), False, "CPU runs"
        ),
        "glm4_9b": Preset(
            ModelArgs(
                arch="glm", vocab_size=151552, hidden_size=4096, num_layers=40, num_heads=32,
                num_kv_heads=2, head_dim=128, intermediate_size=13696, max_seq_len=32768,
                rotary_base=10000.0, norm_eps=1e-5, **GLM_SHAPE,
            ),  # fmt: skip
            True,
            "GLM-4-9B-0414 shape; built only on GPU, validated everywhere",
        ),
    },
    hf=HFSide(
        architecture="Glm4ForCausalLM",
        model_type="glm4",
        defaults={
            **GLM_DEFAULTS,
            "intermediate_size": 13696,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "rms_norm_eps": 1.5625e-07,
            "attention_bias": True,
        },
        read=_read,
        write=_write,
        keys=frozenset({"attention_bias", "use_qk_norm"}),  # Glm4Attention has no QK-norm
        fields={"qkv_bias": "attention_bias"},
        ignored=PADDLEFORMERS_IGNORED,
        checked=GLM_CHECKED,
    ),
)
