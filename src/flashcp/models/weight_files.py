"""A Hugging Face model's weights on disk (no Paddle): which files hold which tensors.

One ``model.safetensors``, or shards listed in ``model.safetensors.index.json`` (its
``weight_map``: tensor name → shard file). `locate` is the one reader of that layout: the
loader (`flashcp.models.hf_weights`), the config checks (`flashcp.models.hf_config`,
`flashcp.config.model_section`) and the exporters all ask it. Nothing here reads tensor data: an
index, or a single file's header (`flashcp.models.safetensors_io.SafetensorsFile`). The
multi-token-prediction rules: a layer the run asks for is missing when the checkpoint holds
none of its tensors (`missing_mtp_layers`; one partly there is the loader's to name tensor by
tensor), and a checkpoint layer is an MTP layer a smaller model skips when it has an
``eh_proj`` (`mtp_layers_in`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from flashcp.models.safetensors_io import ReadCounter, SafetensorsFile

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)
"""The files one of which a model directory's weights start from."""
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class WeightFiles:
    """Where a checkpoint's tensors are: `key_files` (tensor name → file), the distinct
    `files`, the index read (None for one file), and the single file's parsed header."""

    path: str
    key_files: dict[str, Path]
    files: list[Path]
    index: Path | None = None
    single: SafetensorsFile | None = None


def locate(
    path: str | os.PathLike[str], counter: ReadCounter | None = None, *, shards: bool = True
) -> WeightFiles:
    """The weights of a file, a single-file directory or a sharded directory (only the index,
    or the one file's header, is read; through `counter` when given). `FileNotFoundError` /
    `ValueError` naming the file and what to do; with `shards` every shard the index names
    must exist (a load), without it only the index is read (the config checks)."""
    counter = counter or ReadCounter()
    p = Path(path)
    if p.is_dir() and (p / INDEX_FILE).is_file():
        index_path = p / INDEX_FILE
        try:
            index = json.loads(counter.read_text(index_path))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{index_path} is not JSON ({exc}): re-download it") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map' object: re-download it")
        key_files = {k: p / v for k, v in weight_map.items()}
        files = sorted(set(key_files.values()))
        for f in files if shards else ():
            if not f.is_file():
                keys = sorted(k for k, v in key_files.items() if v == f)
                raise FileNotFoundError(
                    f"{index_path} maps {len(keys)} tensors (e.g. {keys[0]}) to {f.name}, which "
                    f"does not exist in {p}: download the missing shard, or point at a "
                    "complete checkpoint"
                )
        return WeightFiles(str(p), key_files, files, index_path)
    if p.is_file():
        file = p
    elif p.is_dir() and (p / SINGLE_FILE).is_file():
        file = p / SINGLE_FILE
    elif p.is_dir():
        found = sorted(p.glob("*.safetensors"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"{p} has no {SINGLE_FILE} or {INDEX_FILE}"
                + (f" and {len(found)} other .safetensors files" if found else "")
                + ": point at one file or add the index (or download the weights)"
            )
        file = found[0]
    else:
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    opened = SafetensorsFile(file, counter)
    return WeightFiles(str(p), {k: file for k in opened.tensors}, [file], None, opened)


def checkpoint_keys(path: str | os.PathLike[str]) -> list[str]:
    """The tensor names of the weights at `path`, sorted (no tensor data is read)."""
    found = locate(path, shards=False)
    if found.single is not None:
        found.single.close()
    return sorted(found.key_files)


def held_layers_from(keys: Collection[str], first: int) -> set[int]:
    """The layer indices ``model.layers.{i}`` with i >= `first` of which `keys` hold any
    tensor: from ``num_layers`` on, the checkpoint's multi-token-prediction layers."""
    held = set()
    for key in keys:
        m = _LAYER_RE.match(key)
        if m is not None and int(m.group(1)) >= first:
            held.add(int(m.group(1)))
    return held


MTP_MARK = "eh_proj.weight"
"""The key (after ``model.layers.{i}.``) that makes checkpoint layer i >= num_layers an MTP
layer (a deeper plain decoder layer is not one: the loader refuses it as unexpected)."""


def mtp_layers_in(keys: Collection[str], num_layers: int) -> set[int]:
    """A checkpoint's MTP layers: those from `num_layers` on with an ``eh_proj`` (`MTP_MARK`),
    which a load skips when the model builds fewer."""
    return {i for i in held_layers_from(keys, num_layers) if f"model.layers.{i}.{MTP_MARK}" in keys}


def missing_mtp_layers(keys: Collection[str], num_layers: int, mtp_layers: int) -> list[int]:
    """The MTP layers ``model.layers.{num_layers + d}`` (d < `mtp_layers`) of which `keys` (a
    checkpoint's tensor names) hold no tensor at all."""
    held = held_layers_from(keys, num_layers)
    return [num_layers + d for d in range(mtp_layers) if num_layers + d not in held]
