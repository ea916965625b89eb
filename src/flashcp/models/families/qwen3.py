"""Qwen3 dense (``arch: qwen3``), exactly as transformers' ``Qwen3ForCausalLM`` computes it:
RMSNorm, GQA with a per-head RMSNorm of q and k before rotary (QK-norm, one weight
`[head_dim]` each), a ``head_dim`` of its own (128 whatever hidden / heads), half-split
rotary, ``attention_bias`` biasing q, k, v and o together, a bias-free SwiGLU MLP. Sliding
windows as Qwen2's (`qwen2`). Qwen3 up to 4B ties the head to the embedding.
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import WINDOW_KEYS, HFSide, Reader, full_attention_only, tied_bias
from flashcp.models.families.qwen2 import QWEN_DEFAULTS
from flashcp.models.families.spec import TINY, Family, Preset

QWEN3_FIXED: dict[str, Any] = {"use_qk_norm": True, "mlp_bias": False, "partial_rotary_factor": 1.0}
"""Qwen3's attention always normalises q and k per head; its MLPs have no bias."""


def _read(r: Reader) -> dict[str, Any]:
    full_attention_only(r)
    return {**tied_bias(r, "attention_bias"), "use_qk_norm": True}


def _write(args: ModelArgs) -> dict[str, Any]:
    return {"attention_bias": args.qkv_bias, "use_sliding_window": False, "sliding_window": None}


FAMILY = Family(
    arch="qwen3",
    title="Qwen3, transformers' Qwen3ForCausalLM",
    fixed=QWEN3_FIXED,
    tied=(("qkv_bias", "o_bias"),),
    presets={
        "tiny_qwen3": Preset(
            ModelArgs(
                arch="qwen3", intermediate_size=128, **{**TINY, "num_heads": 4}, head_dim=32,
                use_qk_norm=True, rotary_base=1000000.0, norm_eps=1e-6,
            ),  # fmt: skip
            False,
            "CPU tests: QK-norm, head_dim 32 != hidden / heads",
        ),
        "qwen3_8b": Preset(
            ModelArgs(
                arch="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                num_kv_heads=8, head_dim=128, intermediate_size=12288, max_seq_len=40960,
                rotary_base=1000000.0, norm_eps=1e-6, use_qk_norm=True,
            ),  # fmt: skip
            True,
            "Qwen3-8B shape; built only on GPU, validated everywhere",
        ),
    },
    hf=HFSide(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        defaults={**QWEN_DEFAULTS, "intermediate_size": 22016, "head_dim": 128,
                  "attention_bias": False},  # fmt: skip
        read=_read,
        write=_write,
        keys=WINDOW_KEYS | {"attention_bias"},
        fields={"qkv_bias": "attention_bias", "o_bias": "attention_bias"},
    ),
)
