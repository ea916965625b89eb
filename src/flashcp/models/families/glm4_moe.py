"""GLM-4.5 / GLM-4.5-Air (``arch: glm_moe``), exactly as transformers' ``Glm4MoeForCausalLM``
computes it: RMSNorm, partial *half-split* (NeoX) rotary, q/k/v bias (``attention_bias``),
GQA, optional per-head QK-norm (``use_qk_norm``, the full GLM-4.5; off in GLM-4.5-Air), a dense
SwiGLU for the first ``first_k_dense_replace`` layers and a mixture of experts after: a sigmoid
top-k router whose selection-only ``e_score_correction_bias`` steers the choice (DeepSeek-V3's
noaux_tc), weights normalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``),
plus shared experts. Its multi-token-prediction layers (``num_nextn_predict_layers``, which
transformers ignores) are built on the last pipeline stage (`flashcp.models.mtp`).

Group-limited routing (``topk_group`` < ``n_group``) is refused; ``n_group == topk_group``
selects among all experts, which is plain top-k. PaddleFormers (1.2.0) saves GLM-4.5 under its
own class names (`PADDLEFORMERS_ARCHS`) in the HF tensor layout (its
``_gen_inv_aoa_config`` splits the fused ``qkv_proj`` / ``up_gate_proj`` back; the router
weight is stored in bfloat16 even in a float32 model, which the loader widens exactly), with
keys of its own, each classified (`glm4.PADDLEFORMERS_IGNORED`, `glm4.GLM_CHECKED`).
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.glm4 import (
    GLM_CHECKED,
    GLM_DEFAULTS,
    GLM_SHAPE,
    PADDLEFORMERS_IGNORED,
)
from flashcp.models.families.hf import HFSide, Reader, moe_counts
from flashcp.models.families.spec import TINY, TINY_MOE, Family, Preset, Router

PADDLEFORMERS_ARCHS = {
    name: "PaddleFormers 1.2.0"
    for name in (
        "Glm4MoeForCausalLMDeprecated",
        "Glm4MoeForCausalLMPipe",
        "Glm4MoeForCausalLMPipeDeprecated",
        "Glm4MoeForCausalLMFleet",
        "Glm4MoeForCausalLMPipeFleet",
    )
}
"""PaddleFormers 1.2.0's GLM-4.5 classes (``paddleformers.transformers.glm4_moe``): each saves
through the same inverse conversion into the HF tensor layout of ``Glm4MoeForCausalLM`` and
writes its own class name into ``architectures``."""

ROUTER = Router(score="sigmoid", correction_bias=True, normalise="sum_eps", aux_loss="sequence")
"""DeepSeek-V3's router as GLM-4.5 uses it (`flashcp.models.moe`)."""


def _read(r: Reader) -> dict[str, Any]:
    n_group, topk_group = r.get("n_group"), r.get("topk_group")
    if n_group != 1 and topk_group != n_group:
        r.problem(
            "topk_group",
            f"group-limited expert routing (n_group {n_group}, topk_group {topk_group}) is not "
            "implemented: flashcp routes top-k over all experts",
        )
    experts = "num_experts" if not r.has("n_routed_experts") and r.has("num_experts") else (
        "n_routed_experts"
    )
    scaling = r.get("routed_scaling_factor")
    return {
        "qkv_bias": r.get("attention_bias"),
        **moe_counts(r, experts, "num_experts_per_tok", "n_shared_experts"),
        "first_k_dense_replace": r.get("first_k_dense_replace"),
        "routed_scaling_factor": float(scaling) if _number(scaling) else scaling,
        "norm_topk_prob": r.get("norm_topk_prob"),
        "use_qk_norm": r.get("use_qk_norm"),
    }


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _write(args: ModelArgs) -> dict[str, Any]:
    return {
        "attention_bias": args.qkv_bias,
        "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "n_shared_experts": args.num_shared_experts,
        "first_k_dense_replace": args.first_k_dense_replace,
        "routed_scaling_factor": args.routed_scaling_factor,
        "norm_topk_prob": args.norm_topk_prob,
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": args.use_qk_norm,
    }


FAMILY = Family(
    arch="glm_moe",
    title="GLM-4.5, transformers' Glm4MoeForCausalLM",
    router=ROUTER,
    mtp=True,
    fixed={"o_bias": False, "mlp_bias": False},
    presets={
        "tiny_glm_moe": Preset(
            ModelArgs(arch="glm_moe", intermediate_size=128, **TINY, **GLM_SHAPE, **TINY_MOE),
            False,
            "CPU tests",
        ),
        "glm45_air": Preset(
            ModelArgs(
                arch="glm_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96,
                num_kv_heads=8, head_dim=128, intermediate_size=10944, max_seq_len=131072,
                rotary_base=1000000.0, norm_eps=1e-5, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=1408, num_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=1.0, norm_topk_prob=True, mtp_layers=1, **GLM_SHAPE,
            ),  # fmt: skip
            True,
            "GLM-4.5-Air shape with its MTP (NextN) layer, frozen unless model.mtp_loss_weight "
            "> 0; built only on GPU, validated everywhere",
        ),
    },
    hf=HFSide(
        architecture="Glm4MoeForCausalLM",
        model_type="glm4_moe",
        defaults={
            **GLM_DEFAULTS,
            "intermediate_size": 10944,
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": None,  # hidden_size // num_attention_heads
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            "moe_intermediate_size": 1408,
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "n_routed_experts": 128,
            "num_experts": 128,
            "routed_scaling_factor": 1.0,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "use_qk_norm": False,
        },
        read=_read,
        write=_write,
        keys=frozenset({
            "attention_bias", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
            "n_routed_experts", "num_experts", "routed_scaling_factor", "n_group", "topk_group",
            "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
        }),  # fmt: skip
        fields={
            "qkv_bias": "attention_bias",
            "use_qk_norm": "use_qk_norm",
            "num_experts": "n_routed_experts",
            "num_experts_per_tok": "num_experts_per_tok",
            "moe_intermediate_size": "moe_intermediate_size",
            "num_shared_experts": "n_shared_experts",
            "first_k_dense_replace": "first_k_dense_replace",
            "routed_scaling_factor": "routed_scaling_factor",
            "norm_topk_prob": "norm_topk_prob",
        },
        aliases=PADDLEFORMERS_ARCHS,
        ignored=PADDLEFORMERS_IGNORED,
        checked=GLM_CHECKED,
    ),
    paddleformers_fused_adapters=True,
)
