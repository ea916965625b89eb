"""Llama 3 / 3.1 / 3.2 (``arch: llama``), exactly as transformers' ``LlamaForCausalLM``
computes it: RMSNorm, GQA, half-split (NeoX) rotary, with Llama-3.1's frequency scaling when
``rope_type: llama3`` (every 3.1 / 3.2 file has it; `flashcp.models.rope`), a SwiGLU MLP,
``attention_bias`` biasing q, k, v and o together, ``mlp_bias`` the MLP's projections, an
optional ``head_dim``. Llama-3.2 1B / 3B tie the head to the embedding.
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import HFSide, Reader, tied_bias
from flashcp.models.families.spec import TINY, Family, Preset

LLAMA31_ROPE: dict[str, Any] = dict(
    rotary_base=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0, rope_original_max_len=8192,
)  # fmt: skip
"""Llama-3.1's RoPE (θ 500000, llama3 scaling by 8 of an 8192-token original context)."""


def _read(r: Reader) -> dict[str, Any]:
    return {**tied_bias(r, "attention_bias"), "mlp_bias": r.get("mlp_bias")}


def _write(args: ModelArgs) -> dict[str, Any]:
    return {"attention_bias": args.qkv_bias, "mlp_bias": args.mlp_bias}


FAMILY = Family(
    arch="llama",
    title="Llama 3.x, transformers' LlamaForCausalLM",
    fixed={"use_qk_norm": False, "partial_rotary_factor": 1.0},
    tied=(("qkv_bias", "o_bias"),),
    presets={
        "tiny_llama": Preset(
            ModelArgs(
                arch="llama", intermediate_size=128, **TINY, rotary_base=500000.0,
                rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0, rope_original_max_len=32,
            ),  # fmt: skip
            False,
            "CPU tests: llama3 RoPE scaling from a 32-token original context",
        ),
        "llama31_8b": Preset(
            ModelArgs(
                arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, intermediate_size=14336, max_seq_len=131072,
                norm_eps=1e-5, **LLAMA31_ROPE,
            ),  # fmt: skip
            True,
            "Llama-3.1-8B shape; built only on GPU, validated everywhere",
        ),
        "llama32_1b": Preset(
            ModelArgs(
                arch="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                num_kv_heads=8, head_dim=64, intermediate_size=8192, max_seq_len=131072,
                norm_eps=1e-5, tie_embeddings=True, **{**LLAMA31_ROPE, "rope_factor": 32.0},
            ),  # fmt: skip
            False,
            "Llama-3.2-1B shape (tied embeddings)",
        ),
    },
    hf=HFSide(
        architecture="LlamaForCausalLM",
        model_type="llama",
        defaults={
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": None,  # num_attention_heads
            "head_dim": None,  # hidden_size // num_attention_heads
            "max_position_embeddings": 2048,
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
        },
        read=_read,
        write=_write,
        keys=frozenset({"attention_bias", "mlp_bias"}),
        fields={"qkv_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias"},
        ignored={"pretraining_tp": "Meta's pretraining (transformers 5.3 does not read it)"},
    ),
)
