"""LoRA adapters on disk, in PaddleFormers' format: written per pipeline stage, read back for
resume and export.

PaddleFormers writes adapters as a sharded safetensors checkpoint: `lora_config.json`,
`config.json`, `peft_model-0000i-of-0000n.safetensors` holding tensors by the model's
structured names (`model.layers.0.self_attn.q_proj.lora_A`) and the index
`peft_model.safetensors.index.json` mapping each name to its shard. That layout lets every
pipeline stage write its own adapters as one shard (`write_adapter_arrays`); the first rank then
writes the index (read from the shards' headers) and the two configs (`write_adapter_meta`), and
the directory loads with PaddleFormers' `LoRAModel.from_pretrained`
(`flashcp.lora.model.load_adapters`) whatever the pipeline layout was. The `lora` config
section itself is applied by `flashcp.lora.setup`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import paddle
from safetensors import safe_open
from safetensors.numpy import save_file

from flashcp.device import host_array
from flashcp.lora.model import LORA_CONFIG_FILE, SAFE_INDEX_FILE, _quiet
from flashcp.lora.setup import LoRASetup


def trainable_arrays(module: paddle.nn.Layer) -> dict[str, np.ndarray]:
    """The trainable parameters of `module` (the adapters, under LoRA) by structured name."""
    return {n: host_array(p) for n, p in module.named_parameters() if not p.stop_gradient}


def load_trainable_arrays(module: paddle.nn.Layer, arrays: Mapping[str, np.ndarray]) -> None:
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


def adapter_files(directory: Path) -> list[Path]:
    """The adapter shards of an exported adapter directory (`<output_dir>/adapters`)."""
    return sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
