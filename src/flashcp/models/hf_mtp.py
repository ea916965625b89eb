"""A Hugging Face checkpoint's multi-token-prediction (MTP) layers, without Paddle: the one
place that says which ones a config.json declares and which ones its weights hold.

GLM-4.5 declares its MTP layers in config.json (``num_nextn_predict_layers``, `MTP_KEY`) and
stores them as decoder layers numbered from ``num_hidden_layers`` on, each with an ``eh_proj``
(`MTP_MARK`). The two can disagree: transformers' ``save_pretrained`` keeps the key and drops
the layer. The rule, read from tensor names alone (`flashcp.models.weight_files`, no tensor
data): a layer the run asks for is missing when the checkpoint holds none of its tensors
(`missing_mtp_layers`; one partly there is the loader's to name tensor by tensor), and a
checkpoint layer from ``num_layers`` on is an MTP layer a smaller model skips when it has an
``eh_proj`` (`mtp_layers_in`); `mtp_depth` names the depth a model's MTP key belongs to.
`mtp_problems` is the refusal `flashcp validate` gives a model directory that declares layers
its weights lack; the notes (`NOTE_MTP`, `NOTE_MTP_SKIPPED`) say what a load does with them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection

from flashcp.models.config import ModelArgs
from flashcp.models.weight_files import checkpoint_keys
from flashcp.problems import Problem, as_fix

MTP_KEY = "num_nextn_predict_layers"
"""config.json key of the number of multi-token-prediction layers (`ModelArgs.mtp_layers`)."""
MTP_MARK = "eh_proj.weight"
"""The key (after ``model.layers.{i}.``) that makes checkpoint layer i >= num_layers an MTP
layer (a deeper plain decoder layer is not one: the loader refuses it as unexpected)."""
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
NOTE_MTP = (
    "num_nextn_predict_layers: the multi-token-prediction layers (model.layers.{L}...) are "
    "built on the last pipeline stage and loaded (transformers' Glm4MoeForCausalLM ignores "
    "them); model.mtp_layers: 0 skips them"
)
NOTE_MTP_SKIPPED = (
    "num_nextn_predict_layers: model.mtp_layers is 0: the multi-token-prediction layers are "
    "not built, their weights not read (an export leaves them out)"
)


def held_layers_from(keys: Collection[str], first: int) -> set[int]:
    """The layer indices ``model.layers.{i}`` with i >= `first` of which `keys` hold any
    tensor: from ``num_layers`` on, the checkpoint's multi-token-prediction layers."""
    held = set()
    for key in keys:
        m = _LAYER_RE.match(key)
        if m is not None and int(m.group(1)) >= first:
            held.add(int(m.group(1)))
    return held


def mtp_layers_in(keys: Collection[str], num_layers: int) -> set[int]:
    """A checkpoint's MTP layers: those from `num_layers` on with an ``eh_proj`` (`MTP_MARK`),
    which a load skips when the model builds fewer."""
    return {i for i in held_layers_from(keys, num_layers) if f"model.layers.{i}.{MTP_MARK}" in keys}


def missing_mtp_layers(keys: Collection[str], num_layers: int, mtp_layers: int) -> list[int]:
    """The MTP layers ``model.layers.{num_layers + d}`` (d < `mtp_layers`) of which `keys` (a
    checkpoint's tensor names) hold no tensor at all."""
    held = held_layers_from(keys, num_layers)
    return [num_layers + d for d in range(mtp_layers) if num_layers + d not in held]


def mtp_problems(
    directory: str | os.PathLike[str], num_layers: int, declared: int, asked: int
) -> list[Problem]:
    """The refusal (``model.mtp_layers``) of a run that asks for `asked` MTP layers (config.json
    ``num_nextn_predict_layers`` `declared` by default) the directory's weights do not hold —
    transformers' ``save_pretrained`` writes GLM-4.5 so: the key kept, the layer dropped — with
    the fix (the layers held); none when they are there (or none is asked). A partly present
    layer is left to the loader, which names each missing tensor."""
    if asked <= 0:
        return []
    missing = missing_mtp_layers(checkpoint_keys(directory), num_layers, asked)
    if not missing:
        return []
    layers = ", ".join(f"model.layers.{i}.*" for i in missing)
    some = "s" if len(missing) > 1 else ""
    why = (
        f"{directory}/config.json declares {MTP_KEY}: {declared}"
        if asked == declared
        else f"model.mtp_layers is {asked}"
    )
    problem = (
        f"{why}, but the weights in {directory} hold no tensor of the multi-token-prediction "
        f"layer{some} {layers} (transformers' save_pretrained leaves them out)"
    )
    fix = as_fix({"model.mtp_layers": missing[0] - num_layers})
    return [Problem("model.mtp_layers", problem, (fix,))]


def mtp_depth(key: str, args: ModelArgs) -> int | None:
    """The MTP depth (0-based) of the model's MTP layer `key` belongs to; None for other keys."""
    m = _LAYER_RE.match(key)
    if m is None or not args.num_layers <= int(m.group(1)) < args.num_layers + args.mtp_layers:
        return None
    return int(m.group(1)) - args.num_layers
