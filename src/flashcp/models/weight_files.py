"""A Hugging Face model's weights on disk (no Paddle): which files hold which tensors.

One ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` listed in
``model.safetensors.index.json`` (its ``weight_map``: tensor name → shard file). The names are
spelled here only: the writers (`flashcp.models.hf_save`, `flashcp.checkpoint.export`,
`flashcp.checkpoint.merge_export`) name shards with `shard_file`, write the index with
`write_index` and sweep an earlier save's files with `is_weight_file`; `locate` is the one
reader of that layout: the loader's checks (`flashcp.models.hf_check`), the config checks
(`flashcp.models.hf_mtp`, `flashcp.config.model_section`) and the exporters all ask it.
Nothing here reads tensor data: an index, or a single file's header
(`flashcp.models.safetensors_io.SafetensorsFile`). What the tensor names say about
multi-token-prediction layers is `flashcp.models.hf_mtp`'s.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from flashcp.models.safetensors_io import ReadCounter, SafetensorsFile

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)
"""The files one of which a model directory's weights start from."""

_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def shard_file(index: int, count: int) -> str:
    """The name of shard `index` (0-based) of `count`: ``model-0000i-of-0000n.safetensors``
    (i = index + 1), Hugging Face's sharded-checkpoint naming."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    """Whether `name` is a weight file a save writes (`SINGLE_FILE` or a `shard_file` name):
    the files a writer removes when an earlier save left ones it did not rewrite."""
    return name == SINGLE_FILE or _SHARD_RE.match(name) is not None


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> Path:
    """Write `directory`'s `INDEX_FILE` (tensor name → shard file, the tensors' total bytes),
    keys sorted, through a temporary name and a rename so a reader never sees half of it."""
    path = directory / INDEX_FILE
    tmp = path.with_name(path.name + ".tmp")
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


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
