"""Checkpoints written in parts by several ranks (pipeline stages, LoRA adapters).

With pipeline parallelism each stage holds different parameters, so one writer per stage (the
rank with cp = dp = 0) writes its own part into the checkpoint's temporary directory; rank 0
then writes the trainer state and a manifest covering every part, and renames the directory,
exactly as `flashcp.checkpoint.format.save_checkpoint` does for a single writer (atomic,
checksummed, pruned). The manifest's `layout` lists the model and optimizer parts, so
`load_checkpoint` merges them; parameter names are the full model's, so a checkpoint loads
into any pipeline layout (each stage keeps the names it holds).

Part names: `model-0000s-of-0000n.safetensors` / `optimizer-0000s-of-0000n.safetensors`
(s = stage + 1). Float32 master weights (bf16 storage or `parallel.shard_optimizer`) are saved
as optimizer shards instead, `optimizer-0000s-of-0000n.shard-0000i-of-0000N.safetensors` (i =
shard index + 1; one per rank when sharded, with its segment map:
`flashcp.checkpoint.optimizer_state`).
With LoRA the model parts are the adapters in PaddleFormers' own format,
`adapters/peft_model-0000s-of-0000n.safetensors` plus its index and configs, so a checkpoint's
`adapters/` directory loads with `flashcp.lora.model.load_adapters`.

The caller sequences the ranks (`begin` on rank 0, barrier, `write_part` on each writer,
barrier, `commit` on rank 0, barrier). The directory must be on a filesystem every writer
sees (one node, or a shared filesystem).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from flashcp import faults
from flashcp.checkpoint.format import (
    FORMAT_VERSION,
    STATE_FILE,
    _contiguous,
    file_entry,
    fsync_file,
    publish,
)

ADAPTER_DIR = "adapters"


def part_names(num_parts: int, *, adapters: bool) -> tuple[list[str], list[str]]:
    """(model part files, optimizer part files), one each per stage, relative to the dir."""
    n = num_parts

    def name(prefix: str, s: int) -> str:
        return f"{prefix}-{s + 1:05d}-of-{n:05d}.safetensors"

    model_prefix = f"{ADAPTER_DIR}/peft_model" if adapters else "model"
    return [name(model_prefix, s) for s in range(n)], [name("optimizer", s) for s in range(n)]


def shard_names(num_stages: int, shards: int) -> list[list[str]]:
    """Optimizer shard files (`flashcp.checkpoint.optimizer_state`), per stage, one per shard index:
    `optimizer-0000s-of-0000n.shard-0000i-of-0000N.safetensors`."""
    return [
        [
            f"optimizer-{s + 1:05d}-of-{num_stages:05d}.shard-{i + 1:05d}-of-{shards:05d}"
            ".safetensors"
            for i in range(shards)
        ]
        for s in range(num_stages)
    ]


def tmp_dir(root: str | Path, step: int) -> Path:
    """Where checkpoint `step`'s parts are written before the commit."""
    return Path(root) / f"step_{step}.tmp"


def begin(root: str | Path, step: int, *, adapters: bool = False) -> Path:
    """Rank 0: an empty temporary directory for checkpoint `step` (a stale one is removed)."""
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / ADAPTER_DIR if adapters else tmp).mkdir(parents=True)
    return tmp


def write_part(
    path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """One writer: a safetensors part (with extra string `metadata`), fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": str(FORMAT_VERSION), **(metadata or {})}
    save_file(_contiguous(arrays), str(path), metadata=meta)
    fsync_file(path)


def commit(
    root: str | Path,
    step: int,
    *,
    state: Mapping[str, Any],
    model_files: Sequence[str],
    optimizer_files: Sequence[str],
    extra_files: Sequence[str] = (),
    optimizer_shards: Sequence[Sequence[str]] = (),
    keep_last: int | None = None,
) -> Path:
    """Rank 0, after every part is written: state + manifest, then the atomic rename.

    `optimizer_shards`: per stage, the ZeRO-1 optimizer shard files (`shard_names`), listed in
    the manifest's layout so `load_checkpoint` hands them to the optimizer."""
    shard_files = [name for stage in optimizer_shards for name in stage]
    root = Path(root)
    tmp = tmp_dir(root, step)
    faults.on_checkpoint_write(step, tmp)  # parts written, manifest not yet: a torn write
    (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=1, sort_keys=True))
    fsync_file(tmp / STATE_FILE)
    files = {}
    for name in [*model_files, *optimizer_files, *shard_files, *extra_files, STATE_FILE]:
        f = tmp / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint part {f} was not written")
        files[name] = file_entry(f)
    layout: dict[str, Any] = {"model": list(model_files), "optimizer": list(optimizer_files)}
    if shard_files:
        layout["optimizer_shards"] = [list(stage) for stage in optimizer_shards]
    return publish(root, tmp, step, files, keep_last=keep_last, extra={"layout": layout})
