"""Models of every registered family (`flashcp.models.families`: GPT, GLM-4, GLM-4.5, ERNIE-4.5
dense and MoE, Llama-3, Qwen2, Qwen3, Qwen3-MoE), with rotary on GLOBAL positions, FlashMask
attention (context-parallel when a CP group is given), activation recompute and HF weights.
A forward pass takes `flashcp.attention.context.AttentionContext` (the mask, the CP group).

    args = preset("tiny_glm")
    model = build_model(args, seed=0)                   # or one pipeline stage of it:
    stage = build_model(args, stage=StageSpec(1, 2, range(1, 2)), seed=0, param_dtype="bfloat16")
    hidden = model(input_ids, positions, AttentionContext(mask=mask.indices, causal=True))
    logp = model.token_logprobs(hidden, labels)   # log p(label) [B, L], chunked over tokens
    logits = model.logits(hidden)                 # or the full float32 logits [B, L, V]

The names below load on first use (PEP 562), so the declarative parts — `ModelArgs`
(`models/config.py`), the families (`models/families/`), config.json reading
(`models/hf_config.py`, `models/hf_rope.py`), the checkpoint's MTP layers (`models/hf_mtp.py`),
the weights' files (`models/weight_files.py`) — import without Paddle
(`tests/unit/repo/test_no_paddle.py`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

EXPORTS: dict[str, str] = {
    "Attention": "flashcp.models.attention",
    "CausalLM": "flashcp.models.base",
    "StageSpec": "flashcp.models.base",
    "RECOMPUTE_MODES": "flashcp.models.config",
    "ModelArgs": "flashcp.models.config",
    "estimate_parameters": "flashcp.models.config",
    "DecoderLM": "flashcp.models.decoder",
    "DEFAULT_LOSS_CHUNK_TOKENS": "flashcp.models.head",
    "HeadInput": "flashcp.models.head",
    "chunked_token_logprobs": "flashcp.models.head",
    "token_logprobs": "flashcp.models.head",
    "PARAM_DTYPES": "flashcp.models.precision",
    "PRESETS": "flashcp.models.sizes",
    "preset": "flashcp.models.sizes",
    "build_model": "flashcp.models.build",
    "CPU_MAX_PARAMETERS": "flashcp.models.build",
}
"""Each name → the module that defines it (loaded on first use)."""

__all__ = ["ARCHS", *EXPORTS]


def __getattr__(name: str) -> Any:
    """A name of `EXPORTS` (imported on first use); `ARCHS`, the registered families' archs;
    the previous release's names, with a `DeprecationWarning` naming where they live now."""
    if name in EXPORTS:
        value = getattr(importlib.import_module(EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name == "ARCHS":
        from flashcp.models.families import names

        return names()
    if name in ("GPTForCausalLM", "GLMForCausalLM"):
        warnings.warn(
            f"flashcp.models.{name} is now flashcp.models.DecoderLM, the one causal LM of every "
            "family (ModelArgs.arch picks it); the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__("DecoderLM")
    if name == "AttentionContext":
        warnings.warn(
            "flashcp.models.AttentionContext moved to flashcp.attention.context (also "
            "flashcp.AttentionContext, docs/api.md); the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        from flashcp.attention.context import AttentionContext

        return AttentionContext
    raise AttributeError(f"module 'flashcp.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
