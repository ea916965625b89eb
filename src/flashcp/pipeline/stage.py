"""One pipeline stage: a contiguous slice of the decoder layers, built on its own.

`split_layers` decides which layers each stage runs; `build_stage` builds stage `s` of `pp`
directly (`flashcp.models.build_model` with a `StageSpec`): its decoder layers by GLOBAL index,
the token (and learned position) embeddings on the first stage, the final norm, the LM head
and the loss on the last. No rank ever holds the full model: every parameter's initial value
is a function of (seed, its name) (`flashcp.models.init`), so a stage built alone equals the
same slice of a one-process model bitwise.

A stage IS a `flashcp.models.CausalLM` (a one-stage pipeline is the whole model):
`PipelineStage` names that class here, for the runner. Parameter names are the full model's
(`model.embed_tokens.weight`, `model.layers.3.mlp...`, `model.norm.weight`, `lm_head.weight`),
so checkpoints and gradient comparisons map by name. Tied embeddings: see
`CausalLM` (each of the first and last stage holds its own copy, gradients summed).

Default split: as even as possible, the extra layers going to the EARLIEST stages, so the last
stage (which also runs the LM head and the loss over the vocabulary, the largest matmul and
logits buffer of the step) gets the fewest, e.g. 5 layers on 2 stages -> [3, 2], 4 on 3 ->
[2, 1, 1]. Under 1F1B the early stages keep more micro-batches in flight, so when activation
memory rather than the head dominates, set `parallel.pp_layers` explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashcp.models import CausalLM, ModelArgs, StageSpec, build_model
from flashcp.pipeline.split import split_layers

PipelineStage = CausalLM
"""This rank's part of the model: a `CausalLM` built for a `StageSpec`."""


def stage_spec(
    args: ModelArgs, stage: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> StageSpec:
    """Stage `stage` of `num_stages` under `split_layers` (`layers_per_stage`: pp_layers)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    ranges = split_layers(args.num_layers, num_stages, layers_per_stage)
    return StageSpec(stage, num_stages, ranges[stage])


def build_stage(
    args: ModelArgs,
    stage: int,
    num_stages: int,
    layers_per_stage: Sequence[int] | None = None,
    *,
    param_dtype: str = "float32",
    seed: int | None = None,
) -> CausalLM:
    """Build pipeline stage `stage` of `num_stages` alone (see the module docstring)."""
    spec = stage_spec(args, stage, num_stages, layers_per_stage)
    return build_model(args, stage=spec, param_dtype=param_dtype, seed=seed)
