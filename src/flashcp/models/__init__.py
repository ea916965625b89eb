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
"""

from __future__ import annotations

import warnings
from typing import Any

import paddle

from flashcp.models.attention import Attention
from flashcp.models.base import CausalLM, StageSpec
from flashcp.models.config import RECOMPUTE_MODES, ModelArgs, estimate_parameters
from flashcp.models.decoder import DecoderLM
from flashcp.models.families import names
from flashcp.models.head import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    HeadInput,
    chunked_token_logprobs,
    token_logprobs,
)
from flashcp.models.init import default_dtype, deferred_init, draw_seed, init_parameters
from flashcp.models.precision import PARAM_DTYPES
from flashcp.models.sizes import PRESETS, preset

# Above this many parameters (of the part built) `build_model` refuses a CPU device.
CPU_MAX_PARAMETERS = 1_000_000_000


def build_model(
    args: ModelArgs,
    *,
    stage: StageSpec | None = None,
    param_dtype: str = "float32",
    seed: int | None = None,
    allow_large_on_cpu: bool = False,
    initialise: bool = True,
) -> CausalLM:
    """Build the model `args` describe, or only pipeline stage `stage` of it, initialised.

    Only the stage's parts are ever created (embeddings on the first stage, its decoder layers
    by GLOBAL index, final norm + head on the last; with `stage.ep_size` > 1 only its ep rank's
    routed experts), directly in `param_dtype` (`float32` or
    `bfloat16`) on Paddle's current device. Every parameter's value is a function of (`seed`,
    its name) only (`flashcp.models.init`), so a stage equals the same slice of the whole model
    bitwise. `seed` None draws one from Paddle's global generator (`paddle.seed(k)` first makes
    the build reproducible).

    `initialise=False` leaves every parameter at the build's constant fill (0, or its rule's
    constant) instead of drawing its values: for a module every parameter of which is loaded
    next (`checkpoint.init_from`, whose loader refuses a checkpoint missing any of them; an
    export shard), where drawing billions of random numbers on the host would only be thrown
    away. The seed is drawn either way, so Paddle's generator advances alike.
    """
    args.check()
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {param_dtype!r}")
    spec = (stage or StageSpec.whole(args.num_layers)).check(args.num_layers)
    if spec.ep_size > 1 and not args.is_moe:
        raise ValueError(
            f"parallel.ep={spec.ep_size} splits the routed experts of a MoE model, but arch "
            f"{args.arch} has none: set parallel.ep=1"
        )
    n = estimate_parameters(
        args, layers=spec.layers, first=spec.is_first, last=spec.is_last, ep_size=spec.ep_size
    )
    if n > CPU_MAX_PARAMETERS and not allow_large_on_cpu and paddle.get_device() == "cpu":
        raise ValueError(
            f"this model has ~{n / 1e9:.1f}B parameters: real-size presets are built only on "
            "GPU (the CPU build would need tens of GB); use a tiny/small preset on CPU"
        )
    seed = draw_seed() if seed is None else int(seed)
    with default_dtype(param_dtype), deferred_init():
        model = DecoderLM(args, stage=spec)
    if initialise:
        init_parameters(model, seed)
    return model


ARCHS = names()
"""The registered model families' `ModelArgs.arch` values."""

__all__ = [
    "ARCHS",
    "CPU_MAX_PARAMETERS",
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "PRESETS",
    "RECOMPUTE_MODES",
    "StageSpec",
    "Attention",
    "CausalLM",
    "DecoderLM",
    "PARAM_DTYPES",
    "HeadInput",
    "ModelArgs",
    "build_model",
    "chunked_token_logprobs",
    "estimate_parameters",
    "preset",
    "token_logprobs",
]


def __getattr__(name: str) -> Any:
    """`flashcp.models.AttentionContext`, the previous release's path: the class, with a
    `DeprecationWarning` naming where it lives now."""
    if name in ("GPTForCausalLM", "GLMForCausalLM"):
        warnings.warn(
            f"flashcp.models.{name} is now flashcp.models.DecoderLM, the one causal LM of every "
            "family (ModelArgs.arch picks it); the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return DecoderLM
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
