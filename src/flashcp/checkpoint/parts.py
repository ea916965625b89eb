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


def _of(index: int, count: int) -> str:
    return f"{index + 1:05d}-of-{count:05d}"


def part_file(prefix: str, stage: int, num_stages: int) -> str:
    """Stage `stage`'s part (`prefix`: "model", "optimizer" or the adapters' "adapters/peft_model"),
    relative to the checkpoint: `{prefix}-0000s-of-0000n.safetensors`."""
    return f"{prefix}-{_of(stage, num_stages)}.safetensors"


def optimizer_shard_file(stage: int, num_stages: int, shard: int, shards: int) -> str:
    """Stage `stage`'s optimizer shard `shard` (`flashcp.checkpoint.optimizer_state`):
    `optimizer-0000s-of-0000n.shard-0000i-of-0000N.safetensors`."""
    return f"optimizer-{_of(stage, num_stages)}.shard-{_of(shard, shards)}.safetensors"


def part_names(num_parts: int, *, adapters: bool) -> tuple[list[str], list[str]]:
    """(model part files, optimizer part files), one each per stage, relative to the dir."""
    model_prefix = f"{ADAPTER_DIR}/peft_model" if adapters else "model"
    return (
        [part_file(model_prefix, s, num_parts) for s in range(num_parts)],
        [part_file("optimizer", s, num_parts) for s in range(num_parts)],
    )


def shard_names(num_stages: int, shards: int) -> list[list[str]]:
    """Optimizer shard files, per stage, one per shard index (`optimizer_shard_file`)."""
    return [
        [optimizer_shard_file(s, num_stages, i, shards) for i in range(shards)]
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
