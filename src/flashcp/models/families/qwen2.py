"""Qwen2 / Qwen2.5 (``arch: qwen2``), exactly as transformers' ``Qwen2ForCausalLM`` computes
it: RMSNorm, GQA, half-split rotary, biases on q, k and v only (hard-wired in the class), a
bias-free SwiGLU MLP. Sliding-window attention is refused unless ``use_sliding_window`` is
false, as every published Qwen2.5 file has it (then ``sliding_window`` and
``max_window_layers`` change nothing). The small models (0.5B-3B) tie the head to the
embedding.
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import WINDOW_KEYS, HFSide, Reader, full_attention_only
from flashcp.models.families.spec import TINY, Family, Preset

QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
"""Defaults transformers' (5.3) ``Qwen2Config`` and ``Qwen3Config`` share."""
QWEN_CHECKED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_mrope": ((False,), "multimodal RoPE belongs to Qwen2.5-VL; the text model rotates 1-D"),
}
"""Keys some Qwen2.5 files write that change the maths: accepted at the value computed."""


def _read(r: Reader) -> dict[str, Any]:
    full_attention_only(r)
    return {"qkv_bias": True}  # Qwen2Attention's q/k/v always carry a bias


def _write(args: ModelArgs) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None}


FAMILY = Family(
    arch="qwen2",
    title="Qwen2 / Qwen2.5, transformers' Qwen2ForCausalLM",
    fixed={
        "qkv_bias": True, "o_bias": False, "mlp_bias": False, "use_qk_norm": False,
        "partial_rotary_factor": 1.0,
    },  # fmt: skip
    presets={
        "tiny_qwen2": Preset(
            ModelArgs(
                arch="qwen2", intermediate_size=128, **TINY, qkv_bias=True, tie_embeddings=True,
                rotary_base=1000000.0, norm_eps=1e-6,
            ),  # fmt: skip
            False,
            "CPU tests: q/k/v biases, tied embeddings",
        ),
        "qwen25_7b": Preset(
            ModelArgs(
                arch="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                head_dim=128,
                num_kv_heads=4, intermediate_size=18944, max_seq_len=131072,
                rotary_base=1000000.0, norm_eps=1e-6, qkv_bias=True,
            ),  # fmt: skip
            True,
            "Qwen2.5-7B shape; built only on GPU, validated everywhere",
        ),
    },
    hf=HFSide(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        defaults={**QWEN_DEFAULTS, "intermediate_size": 22016, "head_dim": None},
        read=_read,
        write=_write,
        keys=WINDOW_KEYS,
        checked=QWEN_CHECKED,
    ),
)
