"""The names and the temporary directory of checkpoints written in parts by several ranks
(pipeline stages, LoRA adapters, optimizer shards).

With pipeline parallelism each stage holds different parameters, so one writer per stage (the
rank with cp = dp = 0) writes its own part into the checkpoint's temporary directory; rank 0
then writes the trainer state and a manifest covering every part, and renames the directory
(`flashcp.checkpoint.saving`: the phases, the agreement, a failed save). The manifest's
`layout` lists the model and optimizer parts, so `load_checkpoint` merges them; parameter
names are the full model's, so a checkpoint loads into any pipeline layout (each stage keeps
the names it holds).

Part names: `model-0000s-of-0000n.safetensors` / `optimizer-0000s-of-0000n.safetensors`
(s = stage + 1). Float32 master weights (bf16 storage or `parallel.shard_optimizer`) are saved
as optimizer shards instead, `optimizer-0000s-of-0000n.shard-0000i-of-0000N.safetensors` (i =
shard index + 1; one per rank when sharded, with its segment map:
`flashcp.checkpoint.optimizer_state`).
With LoRA the model parts are the adapters in PaddleFormers' own format,
`adapters/peft_model-0000s-of-0000n.safetensors` plus its index and configs, so a checkpoint's
`adapters/` directory loads with `flashcp.lora.model.load_adapters`.

The directory must be on a filesystem every writer sees (one node, or a shared filesystem).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flashcp.rundir import ADAPTER_DIR


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
