"""Models: GPT, GLM-4 dense and GLM-4.5 MoE, with rotary on GLOBAL positions, FlashMask
attention (context-parallel when a CP group is given), activation recompute and HF weights.

    args = preset("tiny_glm")
    model = build_model(args)
    hidden = model(input_ids, positions, AttentionContext(mask=mask.indices, causal=True))
    logp = model.token_logprobs(hidden, labels)   # log p(label) [B, L], chunked over tokens
    logits = model.logits(hidden)                 # or the full float32 logits [B, L, V]
"""

from __future__ import annotations

import paddle

from flashcp.models.attention import Attention, AttentionContext
from flashcp.models.base import CausalLM
from flashcp.models.config import ARCHS, RECOMPUTE_MODES, ModelArgs, estimate_parameters
from flashcp.models.glm import GLMForCausalLM
from flashcp.models.gpt import GPTForCausalLM
from flashcp.models.head import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    HeadInput,
    chunked_token_logprobs,
    token_logprobs,
)
from flashcp.models.sizes import PRESETS, preset

# Above this many parameters `build_model` refuses a CPU device (the real GLM shapes).
CPU_MAX_PARAMETERS = 1_000_000_000


def build_model(args: ModelArgs, *, allow_large_on_cpu: bool = False) -> CausalLM:
    """Build (and initialise from Paddle's global seed) the model `args` describe."""
    args.check()
    n = estimate_parameters(args)
    if n > CPU_MAX_PARAMETERS and not allow_large_on_cpu and paddle.get_device() == "cpu":
        raise ValueError(
            f"this model has ~{n / 1e9:.1f}B parameters: real-size presets are built only on "
            "GPU (the CPU build would need tens of GB); use a tiny/small preset on CPU"
        )
    if args.arch == "gpt":
        return GPTForCausalLM(args)
    return GLMForCausalLM(args)


__all__ = [
    "ARCHS",
    "CPU_MAX_PARAMETERS",
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "PRESETS",
    "RECOMPUTE_MODES",
    "Attention",
    "AttentionContext",
    "CausalLM",
    "GLMForCausalLM",
    "GPTForCausalLM",
    "HeadInput",
    "ModelArgs",
    "build_model",
    "chunked_token_logprobs",
    "estimate_parameters",
    "preset",
    "token_logprobs",
]
