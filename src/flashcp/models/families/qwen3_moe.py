"""Qwen3-MoE (``arch: qwen3_moe``; Qwen3-30B-A3B, 235B-A22B), exactly as transformers'
``Qwen3MoeForCausalLM`` computes it: Qwen3's attention (`qwen3`: QK-norm, its own head_dim),
and on every layer not in ``mlp_only_layers`` whose (index + 1) is a multiple of
``decoder_sparse_step`` a mixture of experts: a softmax router choosing the top
``num_experts_per_tok`` of ``num_experts`` (saved by transformers 5.x as
``num_local_experts``), their probabilities divided by their sum when ``norm_topk_prob``; no
shared experts. Its auxiliary loss (``router_aux_loss_coef``, a Switch-style load-balancing
loss) is a training choice: ``model.router_aux_loss_coef`` (`flashcp.models.moe_balance`).

This family's file is the walk-through of `docs/models.md` ("Adding a model family"): it
needed one building block the others lacked (the ``sum`` normalisation and the ``switch`` loss
of `spec.Router`, shared now) and nothing outside its file besides.
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import WINDOW_KEYS, HFSide, Reader, full_attention_only, tied_bias
from flashcp.models.families.qwen2 import QWEN_DEFAULTS
from flashcp.models.families.qwen3 import QWEN3_FIXED
from flashcp.models.families.spec import TINY, Family, Preset, Router

ROUTER = Router(score="softmax", correction_bias=False, normalise="sum", aux_loss="switch")
"""Qwen3-MoE's router (`flashcp.models.moe`)."""


def _read(r: Reader) -> dict[str, Any]:
    full_attention_only(r)
    experts = r.get("num_experts")
    if r.has("num_local_experts"):  # transformers 5.x writes this name (its attribute_map)
        local = r.get("num_local_experts")
        if r.has("num_experts") and local != experts:
            r.problem("num_local_experts", f"{local!r} contradicts num_experts {experts!r}")
        experts = local
    only = r.get("mlp_only_layers")
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in only
    ):
        r.problem("mlp_only_layers", f"{only!r} must be a list of layer indices")
        only = []
    return {
        **tied_bias(r, "attention_bias"),
        "use_qk_norm": True,
        "num_experts": experts,
        "num_experts_per_tok": r.get("num_experts_per_tok"),
        "moe_intermediate_size": r.get("moe_intermediate_size"),
        "num_shared_experts": 0,
        "moe_layer_interval": r.get("decoder_sparse_step"),
        "mlp_only_layers": tuple(only),
        "norm_topk_prob": r.get("norm_topk_prob"),
    }


def _write(args: ModelArgs) -> dict[str, Any]:
    return {
        "attention_bias": args.qkv_bias,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "decoder_sparse_step": args.moe_layer_interval,
        "mlp_only_layers": list(args.mlp_only_layers),
        "norm_topk_prob": args.norm_topk_prob,
        "use_sliding_window": False,
        "sliding_window": None,
    }


FAMILY = Family(
    arch="qwen3_moe",
    title="Qwen3-MoE, transformers' Qwen3MoeForCausalLM",
    router=ROUTER,
    fixed={
        **QWEN3_FIXED, "num_shared_experts": 0, "first_k_dense_replace": 0,
        "moe_layer_end": -1, "routed_scaling_factor": 1.0,
    },  # fmt: skip
    tied=(("qkv_bias", "o_bias"),),
    presets={
        "tiny_qwen3_moe": Preset(
            ModelArgs(
                arch="qwen3_moe", intermediate_size=128, **TINY, head_dim=32, use_qk_norm=True,
                rotary_base=1000000.0, norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, num_shared_experts=0, norm_topk_prob=True,
                mlp_only_layers=(0,),
            ),  # fmt: skip
            False,
            "CPU tests: layer 0 dense (mlp_only_layers), 4 experts top-2",
        ),
        "qwen3_30b_a3b": Preset(
            ModelArgs(
                arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48,
                num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                max_seq_len=40960, rotary_base=1000000.0, norm_eps=1e-6, use_qk_norm=True,
                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                num_shared_experts=0, norm_topk_prob=True,
            ),  # fmt: skip
            True,
            "Qwen3-30B-A3B shape; built only on GPU, validated everywhere",
        ),
    },
    hf=HFSide(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        defaults={
            **QWEN_DEFAULTS,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_key_value_heads": 4,
            "head_dim": None,  # hidden_size // num_attention_heads
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "moe_intermediate_size": 768,
            "num_experts_per_tok": 8,
            "num_experts": 128,
            "norm_topk_prob": False,
            "mlp_only_layers": [],
        },
        read=_read,
        write=_write,
        keys=WINDOW_KEYS | {
            "attention_bias", "decoder_sparse_step", "moe_intermediate_size",
            "num_experts_per_tok", "num_experts", "num_local_experts", "norm_topk_prob",
            "mlp_only_layers",
        },  # fmt: skip
        fields={
            "qkv_bias": "attention_bias",
            "o_bias": "attention_bias",
            "num_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_tok",
            "moe_intermediate_size": "moe_intermediate_size",
            "moe_layer_interval": "decoder_sparse_step",
            "mlp_only_layers": "mlp_only_layers",
            "norm_topk_prob": "norm_topk_prob",
        },
    ),
)
