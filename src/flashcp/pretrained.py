"""`from_pretrained(DIR)`: the model of a Hugging Face directory, from Python.

What `model.from_pretrained` does for a run, for a researcher's own script or notebook: read
``config.json`` as the family's transformers class would (`flashcp.models.hf_config`: every
registered family, refusals named before anything is built), build the model — or only
pipeline stage `stage` of `num_stages`, which then reads only its own tensors — and fill it
from the directory's safetensors (`flashcp.models.hf_load`, every tensor checked by name,
shape and dtype before one is read).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from flashcp.models import CausalLM, build_model
from flashcp.models.hf_config import TRAINING_FIELDS, args_from_hf_config
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.pipeline.stage import stage_spec


def from_pretrained(
    directory: str | os.PathLike[str],
    *,
    stage: int = 0,
    num_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
    param_dtype: str = "float32",
    allow_large_on_cpu: bool = False,
    **training: Any,
) -> CausalLM:
    """The model in `directory` (config.json + safetensors of any family flashcp reads),
    loaded; with `num_stages` > 1 only pipeline stage `stage` of it (the split of
    `flashcp.pipeline.split`, or `layers_per_stage`). `param_dtype` float32 or bfloat16.
    `training` sets how the model trains, not which model it is (`recompute`,
    `residual_dtype`, `tile_tokens`, `mtp_layers`, ... — `hf_config.TRAINING_FIELDS`); any
    other key is refused: the directory's config.json defines the model."""
    other = sorted(set(training) - set(TRAINING_FIELDS))
    if other:
        raise TypeError(
            f"from_pretrained: {', '.join(other)} would change the model config.json defines; "
            f"only the training fields {', '.join(TRAINING_FIELDS)} are set here"
        )
    args = args_from_hf_config(directory, **training)
    spec = stage_spec(args, stage, num_stages, layers_per_stage)
    model = build_model(
        args, stage=spec, param_dtype=param_dtype, seed=0, initialise=False,
        allow_large_on_cpu=allow_large_on_cpu,
    )  # fmt: skip
    load_hf_checkpoint(model, directory)
    return model
