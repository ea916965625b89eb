"""ERNIE-4.5 dense (``arch: ernie4_5``; ERNIE-4.5-0.3B), exactly as transformers'
``Ernie4_5ForCausalLM`` computes it: RMSNorm, GQA, *interleaved* rotary over the whole head
(pairs (2i, 2i+1), θ 500000), a SwiGLU MLP, and one switch ``use_bias`` that biases q, k, v, o
and the MLP's three projections together (the LM head never). The 0.3B model ties its head to
the embedding.

Baidu's first upload names the class ``Ernie4_5_ForCausalLM`` (remote code, with ``auto_map``);
transformers reads that file as this class (its ``model_type`` decides), and so does flashcp.
"""

from __future__ import annotations

from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import PADDLEFORMERS_IGNORED, HFSide, Reader
from flashcp.models.families.spec import TINY, Family, Preset

ERNIE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 103424,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "use_bias": False,
}
"""Defaults transformers' (5.3) ``Ernie4_5Config`` and ``Ernie4_5_MoeConfig`` share."""
ERNIE_FIXED: dict[str, Any] = {"use_qk_norm": False, "partial_rotary_factor": 1.0}
"""ERNIE-4.5 has no QK-norm and rotates every dim of a head."""
ERNIE_TIED = (("qkv_bias", "o_bias", "mlp_bias"),)
"""``use_bias`` sets every projection's bias."""
ERNIE_CHECKED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_rmsnorm": ((True,), "ERNIE-4.5 normalises with RMSNorm, as transformers' class does"),
    "is_quantized": ((False,), "quantized checkpoints are not supported: use the bf16 weights"),
}
"""Keys ERNIE's own configs write that change the maths: accepted at the value flashcp (and
transformers) computes."""


def _read(r: Reader) -> dict[str, Any]:
    bias = r.get("use_bias")
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias}


def _write(args: ModelArgs) -> dict[str, Any]:
    return {"use_bias": args.qkv_bias}


FAMILY = Family(
    arch="ernie4_5",
    title="ERNIE-4.5, transformers' Ernie4_5ForCausalLM",
    rotary_interleaved=True,
    fixed=ERNIE_FIXED,
    tied=ERNIE_TIED,
    presets={
        "tiny_ernie": Preset(
            ModelArgs(
                arch="ernie4_5", intermediate_size=128, **TINY, tie_embeddings=True,
                qkv_bias=True, o_bias=True, mlp_bias=True, rotary_base=500000.0,
            ),  # fmt: skip
            False,
            "CPU tests: tied embeddings, use_bias",
        ),
        "ernie45_0p3b": Preset(
            ModelArgs(
                arch="ernie4_5", vocab_size=103424, hidden_size=1024, num_layers=18,
                num_heads=16, num_kv_heads=2, head_dim=128, intermediate_size=3072,
                max_seq_len=131072, rotary_base=500000.0, norm_eps=1e-5, tie_embeddings=True,
            ),  # fmt: skip
            False,
            "ERNIE-4.5-0.3B shape",
        ),
    },
    hf=HFSide(
        architecture="Ernie4_5ForCausalLM",
        model_type="ernie4_5",
        defaults={
            **ERNIE_DEFAULTS,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 18,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 128,
        },
        read=_read,
        write=_write,
        keys=frozenset({"use_bias"}),
        fields={"qkv_bias": "use_bias", "o_bias": "use_bias", "mlp_bias": "use_bias"},
        aliases={"Ernie4_5_ForCausalLM": "Baidu's remote-code release of ERNIE-4.5"},
        ignored=PADDLEFORMERS_IGNORED,
        checked=ERNIE_CHECKED,
    ),
)
