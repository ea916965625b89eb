"""Building one model (or one pipeline stage of it) from `ModelArgs`: `build_model`."""

from __future__ import annotations

import paddle

from flashcp.models.base import CausalLM, StageSpec
from flashcp.models.config import ModelArgs, estimate_parameters
from flashcp.models.decoder import DecoderLM
from flashcp.models.init import default_dtype, deferred_init, draw_seed, init_parameters
from flashcp.models.precision import PARAM_DTYPES

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
