"""Writing a flashcp model as a Hugging Face checkpoint: safetensors in the HF layout plus its
``config.json``, which transformers and `flashcp.models.hf_load` both read back.

`save_hf_checkpoint` writes every tensor under its checkpoint key, in HF orientation
(`flashcp.models.hf_state.hf_state_map`; MTP layers included), as one ``model.safetensors`` or
shards with their ``model.safetensors.index.json`` above `max_shard_bytes`, and the HF
config of the model's `ModelArgs` (`flashcp.models.hf_config.hf_config`, with
``num_nextn_predict_layers``). Each file is written under a temporary name and renamed, and
weight files of an earlier save that this one did not rewrite are removed, so a reader never
mixes two saves. (A run's merged LoRA export streams its tensors instead:
`flashcp.checkpoint.merge_export`.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import paddle
from paddle import nn
from safetensors.paddle import save_file

from flashcp.models.hf_config import CONFIG_FILE, hf_config
from flashcp.models.hf_state import hf_state_map
from flashcp.models.weight_files import (
    INDEX_FILE,
    SINGLE_FILE,
    is_weight_file,
    shard_file,
    write_index,
)


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _nbytes(t: paddle.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def save_hf_checkpoint(
    model: nn.Layer,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
    dtype: str | None = None,
) -> list[Path]:
    """Write `model` as HF-layout safetensors (+ `config.json`) into `directory`.

    One ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json`` when the total exceeds `max_shard_bytes`. `dtype`
    casts every tensor (default: keep each tensor's dtype). Files are written to temporary
    names and renamed, and model weight files of an earlier save that this one did not
    rewrite are removed, so a loader never mixes two saves. Returns the weight files.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, paddle.Tensor] = {}
    for key, entry in hf_state_map(model).items():
        t = entry.value().detach()
        if entry.transposed:
            t = t.transpose([1, 0])
        if entry.stored is not None:
            t = t.reshape(list(entry.stored))
        if dtype is not None:
            t = t.astype(dtype)
        tensors[key] = t.cpu().contiguous()
    shards: list[dict[str, paddle.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        n = _nbytes(tensors[key])
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += n
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [shard_file(i, len(shards)) for i in range(len(shards))]
    written = []
    for name, shard in zip(names, shards, strict=True):
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        written.append(out / name)
    if len(shards) > 1:
        weight_map = {k: n for n, shard in zip(names, shards, strict=True) for k in shard}
        total = sum(_nbytes(t) for t in tensors.values())
        write_index(out, weight_map, total)
    for stale in out.iterdir():
        stale_index = stale.name == INDEX_FILE and len(shards) == 1
        if (is_weight_file(stale.name) and stale not in written) or stale_index:
            stale.unlink()
    saved_dtype = dtype or str(next(iter(tensors.values())).dtype).replace("paddle.", "")
    _atomic_json(out / CONFIG_FILE, hf_config(model.args, saved_dtype))  # type: ignore[attr-defined]
    return written
