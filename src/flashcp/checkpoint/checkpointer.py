"""`Checkpointer`: everything one rank of a training job reads from and writes to its run's
checkpoints, and the exports at the end of a LoRA run.

The trainer builds it once, from what a checkpoint holds — this rank's model (its pipeline
stage), optimizer, LR scheduler and data stream, the LoRA setup — and calls:

* `save(step, consumed_tokens)` when a save is due, `poll()` at every other step boundary and
  `finish()` before the run ends (collective; `flashcp.checkpoint.saving`: the host snapshot,
  the writer — inline, or in the background with `checkpoint.async` — the agreement, the
  commit and a failed save): one writer (rank 0) for a whole model
  (`flashcp.checkpoint.format`); with pipeline stages, LoRA adapters, float32 master weights or
  expert parallelism each stage's writer adds its part and every rank that owns an optimizer
  shard its shard (`flashcp.checkpoint.parts`); rank 0 then writes the trainer state (LR
  schedule, data position, RNG, config hash) and commits; `keep_last` prunes.
* `resume(tokens_per_step)` at the start of `fit`: the checkpoint `checkpoint.resume` selects
  (`auto`: the newest intact one), loaded into this rank's stage whatever layout wrote it
  (each stage takes the names it holds; expert tensors are whole on disk and sliced here:
  `flashcp.checkpoint.experts`; optimizer state of any form: `flashcp.checkpoint.optimizer_state`),
  with a warning when the config changed; returns the step and consumed tokens it restored.
* `init_masters()` once the optimizer exists: with `checkpoint.init_from` and parameters
  stored in bfloat16/float16, the float32 master weights start from the file's own values.
* `export_lora()` (`export_adapters()`, then `export_merged()`) when a LoRA run ends
  (`flashcp.checkpoint.adapters`, `flashcp.checkpoint.merge_export`); `dump_grads(step)` for
  `debug.dump_grads`.

Nothing here decides when to save or what a step computes: that is the trainer's (it asks
"save now?" at each step boundary and calls `save` or `poll`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
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
from flashcp.checkpoint.merge_export import write_merged_stage
from flashcp.checkpoint.saving import (
    CLASSIC_FILES,
    Commit,
    PartFile,
    SaveReport,
    Saves,
    Snapshot,
)
from flashcp.checkpoint.state import load_model_arrays, model_arrays, rng_state, set_rng_state
from flashcp.config import Config, config_changes, config_hash, hashed_dict
from flashcp.distributed import ParallelGroups, all_gather_object, barrier
from flashcp.lora.setup import LoRASetup
from flashcp.models.hf_load import read_hf_float32
from flashcp.optim.master_optimizer import MasterOptimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.rundir import GRADS_DIR, MERGED_DIR

SAVE_BARRIER_TIMEOUT = 3600.0
"""Other ranks wait this long (s) for the writers of a checkpoint or an export."""
FORMAT_META = {"format": str(ckpt.FORMAT_VERSION)}
"""safetensors metadata of flashcp's own checkpoint files."""
ADAPTER_META = {"format": "np"}
"""safetensors metadata of a LoRA adapter shard (PaddleFormers' format)."""


def _warn(text: str) -> None:
    """A line in this rank's log (stderr: each rank's worker log)."""
    print(text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Resumed:
    """What `Checkpointer.resume` restored."""

    path: Path
    step: int
    consumed_tokens: int


def resume_source(cfg: Config, *, warn: bool = True) -> Path | None:
    """The checkpoint `checkpoint.resume` selects in `cfg`'s run: none (`never`), the newest
    intact one under `<run.output_dir>/checkpoints` (`auto`, broken ones skipped, with a
    warning when `warn`), or the path it names."""
    policy = cfg.checkpoint.resume
    if policy == "never":
        return None
    if policy == "auto":
        root = Path(cfg.run.output_dir) / ckpt.CHECKPOINT_DIR
        return ckpt.latest_checkpoint(root, warn=warn)
    return Path(policy)


def load_weights(
    model: paddle.nn.Layer,
    loaded: ckpt.Checkpoint,
    *,
    stages: int,
    lora: bool,
    experts: ExpertArrays,
) -> None:
    """Fill this rank's `model` (its pipeline stage, its ep share of the experts) from a
    checkpoint's model arrays: with LoRA only the trained adapters (the base comes from where
    the run started), else every parameter of the stage; a stage takes the names it holds, so
    a checkpoint of any pipeline layout loads."""
    arrays = loaded.model
    if lora:
        names = {n for n, p in model.named_parameters() if not p.stop_gradient}
        arrays = {k: v for k, v in arrays.items() if k in names}
        load_trainable_arrays(model, experts.slice(arrays))
        return
    if stages > 1:
        own = set(model.state_dict())
        arrays = {k: v for k, v in arrays.items() if k in own}
    load_model_arrays(model, experts.slice(arrays))


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
        world = groups.world
        self.saves = Saves(
            self.root, rank=int(groups.rank),
            gather=lambda obj: all_gather_object(obj, world, timeout=SAVE_BARRIER_TIMEOUT),
            poll_gather=lambda obj: all_gather_object(obj, world),
            asynchronous=cfg.checkpoint.async_, fail_on_error=cfg.checkpoint.fail_on_error,
            timeout=SAVE_BARRIER_TIMEOUT, echo=self.echo, warn=_warn,
        )  # fmt: skip
        """The save protocol's state on this rank (a save in flight)."""

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
        only, `flashcp.models.hf_load.read_hf_float32`), not from the rounded parameters.
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
        """The checkpoint `checkpoint.resume` selects (`resume_source`)."""
        return resume_source(self.cfg, warn=self.is_main)

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
        _, stages = self._stage
        load_weights(self.model, loaded, stages=stages, lora=self.lora is not None,
                     experts=self.experts)  # fmt: skip
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

    def save(self, step: int, consumed_tokens: int) -> SaveReport:
        """Save checkpoint `step` (collective; `flashcp.checkpoint.saving`): wait for the save
        in flight, copy this rank's part to host memory, and write it — to the end and commit
        (sync), or in the background (`checkpoint.async`; a later `poll` or `finish` commits).
        A failed save is logged by every rank and training goes on (`checkpoint.fail_on_error`:
        `SaveError`). The report carries `checkpoint/stall_s` and rank 0's lines to print."""
        return self.saves.save(step, lambda: self.snapshot(step, consumed_tokens))

    def poll(self) -> SaveReport:
        """At a step boundary without a save (collective): commit the asynchronous save in
        flight once every rank has written its part."""
        return self.saves.poll()

    def finish(self) -> SaveReport:
        """Wait for the save in flight and commit it (collective): before the run ends."""
        return self.saves.finish()

    def snapshot(self, step: int, consumed_tokens: int) -> Snapshot:
        """This rank's part of checkpoint `step`: the files it writes, produced one at a time
        in host memory as they are iterated (every rank iterates them all: under expert
        parallelism producing a file is a collective of the stage writer's ep group), and on
        rank 0 what the commit adds (`flashcp.checkpoint.saving`).

        One writer (rank 0) for a whole model: `model.safetensors` + `optimizer.safetensors`.
        With pipeline stages, LoRA adapters, float32 master weights or expert parallelism, each
        stage's writer has its stage's model (or adapter) part, and the optimizer state goes
        as one part per stage or, with float32 masters, one shard file per rank that owns one
        (`flashcp.checkpoint.parts`). Rank 0 adds the trainer state at the commit."""
        stage, stages = self._stage
        keep = self.cfg.checkpoint.keep_last
        state = self._state(consumed_tokens) if self.is_main else {}
        if not (stages > 1 or self.lora is not None or self._sharded or self.experts.active):
            files = self._classic_files() if self.is_main else iter(())
            commit = Commit(state, None, CLASSIC_FILES, keep) if self.is_main else None
            return Snapshot(step, files, commit)
        adapters = self.lora is not None
        model_files, optimizer_files = parts.part_names(stages, adapters=adapters)
        shard_files: list[list[str]] = []
        if isinstance(self.optimizer, MasterOptimizer):
            optimizer_files = []
            shard_files = parts.shard_names(stages, optimizer_state.shard_files(self.optimizer))
        files = self._part_files(model_files[stage], optimizer_files, shard_files)
        if not self.is_main:
            return Snapshot(step, files)
        layout: dict[str, Any] = {"model": model_files, "optimizer": optimizer_files}
        if shard_files:
            layout["optimizer_shards"] = shard_files
        expected = [*model_files, *optimizer_files, *(n for s in shard_files for n in s)]
        finish = None
        if adapters:

            def finish(tmp: Path) -> list[str]:
                names = self._write_adapter_meta(tmp / parts.ADAPTER_DIR, model_files)
                return [f"{parts.ADAPTER_DIR}/{name}" for name in names]

        return Snapshot(step, files, Commit(state, layout, expected, keep, finish))

    def _classic_files(self) -> Iterator[PartFile]:
        """Rank 0's files of the one-writer layout."""
        assert isinstance(self.optimizer, ParamOptimizer)
        yield PartFile(ckpt.MODEL_FILE, model_arrays(self.model), FORMAT_META)
        pieces = self.optimizer.state_pieces()
        yield PartFile(ckpt.OPTIMIZER_FILE, optimizer_state.classic_arrays(pieces))

    def _part_files(
        self, model_file: str, optimizer_files: list[str], shard_files: list[list[str]]
    ) -> Iterator[PartFile]:
        """This rank's files of a checkpoint in parts: its stage's model (or adapter) part if
        it is the stage writer (expert tensors whole, collected from its ep group), then its
        optimizer part or shard (every rank runs the collections)."""
        stage, _ = self._stage
        if self.lora is not None:
            arrays = self.experts.collect(lambda: trainable_arrays(self.model))
            if arrays is not None:
                yield PartFile(model_file, arrays, ADAPTER_META)
        else:
            arrays = self.experts.collect(lambda: model_arrays(self.model))
            if arrays is not None:
                yield PartFile(model_file, arrays, FORMAT_META)
        del arrays
        opt = self.optimizer
        if isinstance(opt, MasterOptimizer):
            if optimizer_state.writes_shard_file(opt):
                shard = optimizer_state.shard_file(opt)
                yield PartFile(shard_files[stage][shard.index], shard.tensors(),
                               {**FORMAT_META, **shard.metadata()})  # fmt: skip
            return
        pieces = opt.state_pieces
        arrays = self.experts.collect(
            lambda: optimizer_state.classic_arrays(pieces()), optimizer_state.optimizer_key
        )
        if arrays is not None:  # the stage writer
            yield PartFile(optimizer_files[stage], arrays, FORMAT_META)

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

    def export_lora(self, echo: Callable[[str], None]) -> None:
        """A LoRA run's end (collective): the adapters (`export_adapters`) and, with
        `lora.merge_at_end`, the merged model (`export_merged`), each told to `echo` once
        written; nothing without LoRA."""
        out = self.export_adapters()
        if out is None:
            return
        echo(f"saved LoRA adapters (PaddleFormers format) to {out}")
        if self.cfg.extras["lora"].merge_at_end:
            echo(f"saved the merged model to {self.export_merged()}")

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
