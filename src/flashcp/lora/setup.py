"""LoRA in the trainer: adapters from the `lora` config section, saved per pipeline stage in
PaddleFormers' format, loaded back for resume, merged for export.

PaddleFormers writes adapters as a sharded safetensors checkpoint: `lora_config.json`,
`config.json`, `peft_model-0000i-of-0000n.safetensors` holding tensors by the model's
structured names (`model.layers.0.self_attn.q_proj.lora_A`) and the index
`peft_model.safetensors.index.json` mapping each name to its shard. That layout lets every
pipeline stage write its own adapters as one shard (`write_adapter_part`); the first rank then
writes the index (read from the shards' headers) and the two configs (`write_adapter_meta`), and
the directory loads with PaddleFormers' `LoRAModel.from_pretrained`
(`flashcp.lora.model.load_adapters`) whatever the pipeline layout was.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from safetensors import safe_open
from safetensors.numpy import save_file

from flashcp.distributed import all_gather_object
from flashcp.lora.model import (
    LORA_CONFIG_FILE,
    SAFE_INDEX_FILE,
    _quiet,
    apply_lora,
    check_targets,
    target_summary,
)

MERGED_DIR = "merged"
"""Where the merged model is exported in run.output_dir (`flashcp.checkpoint.merge_export`)."""


@dataclass
class LoRASetup:
    """What the trainer keeps of a `LoRAModel` after the full model is split into stages: the
    PaddleFormers configs that go next to the saved adapters."""

    lora_config: Any
    model_config: Any


def apply_lora_config(
    model: paddle.nn.Layer, section: Any, *, group: Any = None, seed: int | None = None
) -> LoRASetup:
    """Apply the `lora` config section to `model` in place (only adapters stay trainable).

    `model` may be one pipeline stage: `group` (the pp group) pools every stage's matches so a
    pattern need only match on some stage (the check raises the same error on every rank).
    `seed` keys the adapters' initial values by name (`flashcp.lora.model.init_adapters`).
    """
    patterns = list(section.target_modules)
    summary = target_summary(model, patterns)
    summaries = [summary]
    if group is not None and int(group.nranks) > 1:
        summaries = all_gather_object(summary, group)
    check_targets(summaries)
    lora = apply_lora(
        model,  # type: ignore[arg-type]
        rank=int(section.rank),
        alpha=float(section.alpha),
        dropout=float(section.dropout),
        target_modules=patterns,
        seed=seed,
        require_match=False,
    )
    return LoRASetup(lora_config=lora.lora_config, model_config=model.config)


def trainable_arrays(module: paddle.nn.Layer) -> dict[str, np.ndarray]:
    """The trainable parameters of `module` (the adapters, under LoRA) by structured name."""
    return {n: p.numpy() for n, p in module.named_parameters() if not p.stop_gradient}


def load_trainable_arrays(module: paddle.nn.Layer, arrays: dict[str, np.ndarray]) -> None:
    """Set `module`'s trainable parameters from `arrays` (extra names, e.g. other stages'
    adapters, are ignored); `ValueError` naming a missing or misshapen one."""
    for name, p in module.named_parameters():
        if p.stop_gradient:
            continue
        if name not in arrays:
            raise ValueError(
                f"the checkpoint has no adapter {name!r} (was it saved with other "
                "lora.target_modules or another model?)"
            )
        value = arrays[name]
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"checkpoint adapter {name} has shape {list(value.shape)}, the model "
                f"{list(p.shape)} (another lora.rank?)"
            )
        p.set_value(value.astype(p.numpy().dtype, copy=False))


def write_adapter_part(path: Path, module: paddle.nn.Layer) -> None:
    """One stage's adapters as a PaddleFormers shard at `path`."""
    write_adapter_arrays(path, trainable_arrays(module))


def write_adapter_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Adapter arrays (e.g. a stage's, expert adapters collected whole from its ep group) as a
    PaddleFormers shard at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    save_file(out, str(path), metadata={"format": "np"})


def write_adapter_meta(directory: Path, shards: Sequence[str], setup: LoRASetup) -> list[str]:
    """Index (from the shards' headers) and configs of an adapter directory; returns the file
    names written, relative to `directory`."""
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(str(directory / shard), "np") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key not in weight_map:
                    weight_map[key] = shard
                    total += int(f.get_tensor(key).nbytes)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / SAFE_INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n")
    with _quiet():
        setup.lora_config.save_pretrained(str(directory))
        setup.model_config.save_pretrained(str(directory))
    return [SAFE_INDEX_FILE, LORA_CONFIG_FILE, "config.json"]
