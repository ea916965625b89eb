"""`Checkpointer`: everything one rank of a training job reads from and writes to its run's
checkpoints, and the exports at the end of a LoRA run.

The trainer builds it once, from what a checkpoint holds — this rank's model (its pipeline
stage), optimizer, LR scheduler and data stream, the LoRA setup — and calls:

* `save(step, consumed_tokens)` every `checkpoint.every` steps (collective): one writer (rank
  0) for a whole model (`flashcp.checkpoint.format`); with pipeline stages, LoRA adapters,
  float32 master weights or expert parallelism each stage's writer adds its part and every rank
  that owns an optimizer shard its shard (`flashcp.checkpoint.parts`); rank 0 then writes the
  trainer state (LR schedule, data position, RNG, config hash) and commits; `keep_last` prunes.
* `resume(tokens_per_step)` at the start of `fit`: the checkpoint `checkpoint.resume` selects
  (`auto`: the newest intact one), loaded into this rank's stage whatever layout wrote it
  (each stage takes the names it holds; expert tensors are whole on disk and sliced here:
  `flashcp.checkpoint.experts`; optimizer state of any form: `flashcp.checkpoint.optimizer_state`),
  with a warning when the config changed; returns the step and consumed tokens it restored.
* `init_masters()` once the optimizer exists: with `checkpoint.init_from` and parameters
  stored in bfloat16/float16, the float32 master weights start from the file's own values.
* `export_adapters()` / `export_merged()` when a LoRA run ends (`flashcp.checkpoint.adapters`,
  `flashcp.checkpoint.merge_export`); `dump_grads(step)` for `debug.dump_grads`.

Nothing here decides when to save or what a step computes: that is the trainer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from safetensors.numpy import save_file

from flashcp.checkpoint import format as ckpt
from flashcp.checkpoint import optimizer_state, parts
from flashcp.checkpoint.adapters import (
    load_trainable_arrays,
    trainable_arrays,
    write_adapter_arrays,
    write_adapter_meta,
)
from flashcp.checkpoint.experts import ExpertArrays
from flashcp.checkpoint.export import finish_hf_directory
from flashcp.checkpoint.merge_export import MERGED_DIR, write_merged_stage
from flashcp.checkpoint.state import load_model_arrays, model_arrays, rng_state, set_rng_state
from flashcp.config import Config, config_changes, config_hash, hashed_dict
from flashcp.distributed import ParallelGroups, barrier
from flashcp.lora.setup import LoRASetup
from flashcp.models.hf_weights import read_hf_float32
from flashcp.optim.zero import MasterOptimizer, ParamOptimizer

GRADS_DIR = "grads"
"""`debug.dump_grads` writes `<output_dir>/grads/step_N[.stageS].safetensors`."""
SAVE_BARRIER_TIMEOUT = 3600.0
"""Other ranks wait this long (s) for the writers of a checkpoint or an export."""


@dataclass(frozen=True)
class Resumed:
    """What `Checkpointer.resume` restored."""

    path: Path
    step: int
    consumed_tokens: int


class Checkpointer:
    """This rank's checkpoint reads and writes (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        groups: ParallelGroups,
        *,
        model: paddle.nn.Layer,
        optimizer: ParamOptimizer | MasterOptimizer,
        scheduler: Any,
        data: Any,
        experts: ExpertArrays,
        lora: LoRASetup | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.groups = groups
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.experts = experts
        """Gathers / slices the expert-parallel tensors' rows (ep > 1)."""
        self.lora = lora
        self.echo = echo or (lambda _text: None)
        """Prints on rank 0 (the trainer's output)."""
        self.output_dir = Path(cfg.run.output_dir)
        self.root = self.output_dir / ckpt.CHECKPOINT_DIR
        self.is_main = int(groups.rank) == 0

    @property
    def _stage(self) -> tuple[int, int]:
        """(pipeline stage, stages)."""
        return int(self.groups.pp.rank), int(self.groups.pp.nranks)

    @property
    def is_stage_writer(self) -> bool:
        """This rank writes its pipeline stage's parts (cp = dp = 0)."""
        return int(self.groups.cp.rank) == 0 and int(self.groups.dp.rank) == 0

    @property
    def _sharded(self) -> bool:
        """Optimizer state is saved as per-rank shard files (float32 masters)."""
        return isinstance(self.optimizer, MasterOptimizer)

    # -- start ------------------------------------------------------------------------------

    def init_masters(self) -> None:
        """With `checkpoint.init_from` and parameters stored in bfloat16/float16, the float32
        master weights this rank holds start from the checkpoint's own values (its slices
        only, `flashcp.models.hf_weights.read_hf_float32`), not from the rounded parameters.
        (A resumed run then overwrites them with the checkpoint's masters.)"""
        opt = self.optimizer
        path = self.cfg.checkpoint.init_from
        if path is None or not isinstance(opt, MasterOptimizer) or opt.low_precision is None:
            return
        if self.lora is not None:
            return  # the trained parameters are the adapters, which the checkpoint lacks
        values, _ = read_hf_float32(self.model, path, opt.master_slices())
        opt.set_masters(values)

    # -- resume -----------------------------------------------------------------------------

    def source(self) -> Path | None:
        """The checkpoint `checkpoint.resume` selects: none (`never`), the newest intact one
        under the run's checkpoints (`auto`, broken ones skipped with a warning), or a path."""
        policy = self.cfg.checkpoint.resume
        if policy == "never":
            return None
        if policy == "auto":
            return ckpt.latest_checkpoint(self.root, warn=self.is_main)
        return Path(policy)

    def resume(self, tokens_per_step: int) -> Resumed | None:
        """Load the checkpoint `source()` selects into this rank's model, optimizer, LR
        schedule, data stream and RNGs; None when there is none. `tokens_per_step` counts the
        consumed tokens of a checkpoint that did not record them."""
        source = self.source()
        if source is None:
            return None
        loaded = ckpt.load_checkpoint(source)
        state = loaded.state
        changed = []
        if state.get("config_hash") != config_hash(self.cfg) and self.is_main:
            changed = config_changes(state.get("config", {}), self.cfg)
        if changed:
            self.echo(
                f"warning: resuming from {source} with a changed config ({', '.join(changed)});"
                " the run will not match an uninterrupted one"
            )
        saved_steps = state.get("train_steps", self.cfg.train.steps)
        if saved_steps != self.cfg.train.steps:
            self.echo(
                f"note: train.steps changed from {saved_steps} to {self.cfg.train.steps} since "
                f"{source}: the cosine schedule is recomputed for the new length"
            )
        self._load_arrays(loaded)
        self.scheduler.set_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        tokens = int(state.get("consumed_tokens", loaded.step * tokens_per_step))
        return Resumed(path=source, step=loaded.step, consumed_tokens=tokens)

    def _load_arrays(self, loaded: ckpt.Checkpoint) -> None:
        """Model (or adapters) and optimizer state; a pipeline stage takes the names it holds,
        so a checkpoint of any pipeline layout loads (the optimizer reads only its own
        parameters' state, by element range: any dp × cp × ep layout)."""
        model = loaded.model
        _, stages = self._stage
        if self.lora is not None:
            names = {n for n, p in self.model.named_parameters() if not p.stop_gradient}
            model = {k: v for k, v in model.items() if k in names}
            load_trainable_arrays(self.model, self.experts.slice(model))
        else:
            if stages > 1:
                own = set(self.model.state_dict())
                model = {k: v for k, v in model.items() if k in own}
            load_model_arrays(self.model, self.experts.slice(model))
        source = optimizer_state.source_for(loaded.optimizer, loaded.optimizer_shards)
        self.optimizer.load_state(source)

    # -- save -------------------------------------------------------------------------------

    def _state(self, consumed_tokens: int) -> dict[str, Any]:
        g = self.groups
        return {
            "config_hash": config_hash(self.cfg),
            "config": hashed_dict(self.cfg),
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": rng_state(),
            "parallel": {
                "dp": int(g.dp.nranks),
                "pp": int(g.pp.nranks),
                "cp": int(g.cp.nranks),
                "ep": int(g.ep.nranks),
                "shard_optimizer": self.cfg.parallel.shard_optimizer,
            },
            "train_steps": self.cfg.train.steps,
            "consumed_tokens": consumed_tokens,
        }

    def save(self, step: int, consumed_tokens: int) -> Path | None:
        """Write checkpoint `step` (collective: rank 0 returns its path); every rank waits.

        One writer (rank 0) for a whole model; with pipeline stages or LoRA adapters each
        stage's writer adds its part, and float32 master weights (sharded or not) are written
        as one optimizer shard per rank that owns one (`flashcp.checkpoint.parts`).
        """
        _, stages = self._stage
        if stages > 1 or self.lora is not None or self._sharded or self.experts.active:
            return self._save_parts(step, consumed_tokens)
        path = None
        if self.is_main:
            assert isinstance(self.optimizer, ParamOptimizer)
            path = ckpt.save_checkpoint(
                self.root,
                step,
                model=model_arrays(self.model),
                optimizer=optimizer_state.classic_arrays(self.optimizer.state_pieces()),
                state=self._state(consumed_tokens),
                keep_last=self.cfg.checkpoint.keep_last,
            )
        barrier(self.groups.world, timeout=SAVE_BARRIER_TIMEOUT)
        return path

    def _save_parts(self, step: int, consumed_tokens: int) -> Path | None:
        world = self.groups.world
        stage, stages = self._stage
        adapters = self.lora is not None
        model_files, optimizer_files = parts.part_names(stages, adapters=adapters)
        shard_files: list[list[str]] = []
        if isinstance(self.optimizer, MasterOptimizer):
            optimizer_files = []
            shard_files = parts.shard_names(stages, optimizer_state.shard_files(self.optimizer))
        if self.is_main:
            parts.begin(self.root, step, adapters=adapters)
        state = self._state(consumed_tokens) if self.is_main else {}
        barrier(world, timeout=SAVE_BARRIER_TIMEOUT)
        tmp = parts.tmp_dir(self.root, step)
        self._write_model_part(tmp, model_files[stage])
        if isinstance(self.optimizer, MasterOptimizer):
            self._write_optimizer_shard(self.optimizer, tmp, shard_files[stage])
        else:
            pieces = self.optimizer.state_pieces
            arrays = self.experts.collect(
                lambda: optimizer_state.classic_arrays(pieces()), optimizer_state.optimizer_key
            )
            if arrays is not None:  # the stage writer
                parts.write_part(tmp / optimizer_files[stage], arrays)
        barrier(world, timeout=SAVE_BARRIER_TIMEOUT)
        path = None
        if self.is_main:
            extra = self._write_adapter_meta(tmp / parts.ADAPTER_DIR, model_files)
            path = parts.commit(
                self.root,
                step,
                state=state,
                model_files=model_files,
                optimizer_files=optimizer_files,
                optimizer_shards=shard_files,
                extra_files=[f"{parts.ADAPTER_DIR}/{name}" for name in extra],
                keep_last=self.cfg.checkpoint.keep_last,
            )
        barrier(world, timeout=SAVE_BARRIER_TIMEOUT)
        return path

    @staticmethod
    def _write_optimizer_shard(opt: MasterOptimizer, directory: Path, names: list[str]) -> None:
        """This rank's optimizer shard, if it writes one (unsharded masters: the stage writer;
        with trainable experts under ep, each ep rank's first edp rank)."""
        if not optimizer_state.writes_shard_file(opt):
            return
        arrays = optimizer_state.shard_file(opt)
        parts.write_part(directory / names[arrays.index], arrays.tensors(), arrays.metadata())

    def _write_model_part(self, directory: Path, name: str) -> None:
        """The stage writer writes its stage's model (or adapter) part, expert tensors whole
        (collected from its ep group, `flashcp.checkpoint.experts`)."""
        if self.lora is not None:
            arrays = self.experts.collect(lambda: trainable_arrays(self.model))
            if arrays is not None:
                write_adapter_arrays(directory / name, arrays)
                ckpt.fsync_file(directory / name)
        else:
            arrays = self.experts.collect(lambda: model_arrays(self.model))
            if arrays is not None:
                parts.write_part(directory / name, arrays)

    def _write_adapter_meta(self, directory: Path, model_files: list[str]) -> list[str]:
        if self.lora is None:
            return []
        prefix = f"{parts.ADAPTER_DIR}/"
        shards = [f.removeprefix(prefix) for f in model_files]
        return write_adapter_meta(directory, shards, self.lora)

    # -- exports ----------------------------------------------------------------------------

    def export_adapters(self) -> Path | None:
        """Write the adapters in PaddleFormers' format to `<output_dir>/adapters` (collective;
        each pipeline stage writes its shard); returns the directory (None without LoRA)."""
        if self.lora is None:
            return None
        stage, stages = self._stage
        out = self.output_dir / parts.ADAPTER_DIR
        files, _ = parts.part_names(stages, adapters=True)
        shard = files[stage].removeprefix(f"{parts.ADAPTER_DIR}/")
        arrays = self.experts.collect(lambda: trainable_arrays(self.model))
        if arrays is not None:  # the stage writer, experts whole
            write_adapter_arrays(out / shard, arrays)
        barrier(self.groups.world, timeout=SAVE_BARRIER_TIMEOUT)
        if self.is_main:
            self._write_adapter_meta(out, files)
        barrier(self.groups.world, timeout=SAVE_BARRIER_TIMEOUT)
        return out

    def export_merged(self) -> Path:
        """Write base + adapters as a Hugging Face model directory in `<output_dir>/merged`,
        streamed stage by stage (collective: each stage's writer merges and writes its own
        shard — under ep each ep rank's writer its experts' — no rank holding more than its
        stage), then rank 0 completes it as `flashcp export --merge-lora` does
        (`finish_hf_directory`: index, config.json, tokenizer, generation config)."""
        g = self.groups
        ep_rank, ep = int(g.ep.rank), int(g.ep.nranks)
        out = self.output_dir / MERGED_DIR
        if ep == 1 and self.is_stage_writer:
            write_merged_stage(self.model, out)
        elif ep > 1 and int(g.edp.rank) == 0:  # each ep rank its experts
            write_merged_stage(self.model, out, ep_rank=ep_rank, ep=ep)
        barrier(g.world, timeout=SAVE_BARRIER_TIMEOUT)
        if self.is_main:
            shards = self._stage[1] * ep
            finish_hf_directory(out, self.cfg, shards, self.cfg.train.param_dtype)
        barrier(g.world, timeout=SAVE_BARRIER_TIMEOUT)
        return out

    def dump_grads(self, step: int, grads: Callable[[], Mapping[str, np.ndarray]]) -> None:
        """`grads/step_N.safetensors` (pp = 1) or one `step_N.stageS.safetensors` per stage of
        `grads()` (the summed gradients), written by the stage writer (expert gradients whole,
        collected from its ep group)."""
        arrays = self.experts.collect(grads)
        if arrays is None:
            return
        stage, stages = self._stage
        out = self.output_dir / GRADS_DIR
        out.mkdir(parents=True, exist_ok=True)
        suffix = f".stage{stage}" if stages > 1 else ""
        save_file(arrays, str(out / f"step_{step}{suffix}.safetensors"))
