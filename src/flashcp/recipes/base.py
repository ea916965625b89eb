"""What a training recipe supplies to the trainer: data, model setup, loss and extra metrics.

The trainer (`flashcp.trainer.Trainer`) owns everything a recipe shares: process groups,
the model (and its pipeline split), the optimizer, gradient synchronisation, clipping,
non-finite handling, checkpoints and the metrics file. A recipe owns what differs:

* `build_data()`: the step source (`next_step()` gives this dp rank's micro-batches of FULL
  sequences; `state_dict()` / `load_state_dict()` make it resumable);
* `setup_model(model)`: changes to this rank's freshly built model — its pipeline stage, built
  stage-only (LoRA adapters; a frozen reference copy for DPO, of the stage only);
* `plan(batches)`: this rank's `MicroBatch`es (cp shards) with a `loss` closure each, plus the
  step's global token counts. A micro-batch's loss must already be normalised by a GLOBAL
  count (all micro-batches, all dp / cp ranks), so summing gradients over ranks gives the
  gradient of one big batch whatever the layout;
* the loss closure's input: `loss(out)` receives a `flashcp.models.HeadInput`, the final-norm
  hidden states `[B, L_local, H]` of the model (pp = 1) or of the last pipeline stage, with
  that module as the LM head. Recipes never see full logits: they call
  `out.token_logprobs(labels, chunk_tokens=cfg.train.loss_chunk_tokens)` (log p(label) per
  local token, 0 on ignored labels), which runs the head over token chunks and recomputes each
  chunk's logits in backward (`flashcp.models.head`);
* `prepare(plan, runner)`: forward-only passes the loss needs first (DPO reference log-probs;
  `runner.forward_only(micro, out_fn, module)` calls `out_fn(HeadInput, mb)` likewise);
* `loss_value(micro_losses)`, `step_stats()`, `metrics(stats)`: this rank's share of the step
  loss and of extra statistics, which the trainer sums over every rank, and the metrics made
  from the sums;
* evaluation (`eval.path`, `flashcp.evaluate`): `build_eval_data(path)` (the recipe's
  data on another file, one row at a time; default: `build_data` of a copy of the recipe
  whose config reads `path`), `eval_sums(batches, runner, module)` (this rank's share of an
  eval batch's sums, from forward-only passes) and `eval_metrics(sums)`.

The runner (`flashcp.pipeline.runner.PipelineRunner`) runs `plan.micro` forward and backward
under the pipeline schedule, each closure on the last stage (pp = 1: the whole model is the one
stage, the micro-batches run one after the other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, ClassVar, Protocol

import numpy as np
import paddle

from flashcp.config import Config
from flashcp.data.peers import Peers
from flashcp.distributed import ParallelGroups, all_gather_object
from flashcp.pipeline.runner import MicroBatch, PipelineRunner


class StepSource(Protocol):
    """A recipe's data: this dp rank's micro-batches per step, resumable."""

    @property
    def seq_len(self) -> int: ...

    def next_step(self) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def describe(self) -> str: ...


DATA_INDEX_TIMEOUT = 3600.0
"""Seconds a rank waits for the others to finish indexing their share of the data rows
(`flashcp.data.index`): tokenizing a large dataset's share can take minutes."""


@dataclass
class RecipeContext:
    """What a recipe may know about the run: config, groups, device and how to shard."""

    cfg: Config
    groups: ParallelGroups
    assignment_for: Callable[[Any], Any]
    """The CP layout (`flashcp.cp.layout.Assignment`) of a batch with a global `.mask`."""
    dtype: str = "float32"
    """The compute dtype, `train.dtype` resolved for the device (`trainer.loop.resolve_dtype`)."""

    @property
    def cp_rank(self) -> int:
        return int(self.groups.cp.rank)

    @property
    def cp_size(self) -> int:
        return int(self.groups.cp.nranks)

    @property
    def dp_rank(self) -> int:
        return int(self.groups.dp.rank)

    @property
    def dp_size(self) -> int:
        return int(self.groups.dp.nranks)

    @property
    def is_last_stage(self) -> bool:
        return int(self.groups.pp.rank) == int(self.groups.pp.nranks) - 1

    def data_peers(self) -> Peers:
        """Every rank of the job, to index the data rows together (`flashcp.data.index`)."""
        world = self.groups.world
        gather = partial(all_gather_object, group=world, timeout=DATA_INDEX_TIMEOUT)
        return Peers(rank=int(world.rank), size=int(world.nranks), gather=gather)

    def autocast(self) -> Any:
        """The forward pass's autocast context (bfloat16 O1 when the compute dtype is bf16)."""
        bf16 = self.dtype == "bfloat16"
        return paddle.amp.auto_cast(enable=bf16, dtype="bfloat16", level="O1")


@dataclass
class SingleRowContext(RecipeContext):
    """A `RecipeContext` that builds data as if there were one dp rank (eval sets)."""

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1


@dataclass
class StepPlan:
    """One optimizer step as this rank runs it."""

    micro: list[MicroBatch]
    tokens: int
    """Tokens the whole job processes this step (padding included)."""
    targets: int
    """Target tokens (labels) of the whole job this step."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Recipe-private per-step data (e.g. DPO reference log-probs)."""


class Recipe:
    """Base recipe: override `build_data`, `plan` and, where needed, the other hooks."""

    name: ClassVar[str] = ""

    def __init__(self, ctx: RecipeContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.lora: Any = None
        """`flashcp.lora.setup.LoRASetup` once `setup_model` applied a `lora` section."""

    def build_data(self) -> StepSource:
        raise NotImplementedError

    def setup_model(self, model: paddle.nn.Layer) -> None:
        """Change this rank's model (its pipeline stage) before training (default: nothing)."""

    def apply_lora(self, model: paddle.nn.Layer) -> bool:
        """Apply the `lora` section, if any, to this rank's stage (target patterns checked over
        every stage, adapters keyed by `train.seed`); returns whether it did."""
        section = self.cfg.extras.get("lora")
        if section is None:
            return False
        from flashcp.lora.setup import apply_lora_config

        self.lora = apply_lora_config(
            model, section, group=self.ctx.groups.pp, seed=self.cfg.train.seed
        )
        return True

    def plan(self, batches: list[Any]) -> StepPlan:
        raise NotImplementedError

    def prepare(self, plan: StepPlan, runner: PipelineRunner, module: paddle.nn.Layer) -> None:
        """Forward-only work before the training passes (default: nothing)."""

    def loss_value(self, micro_losses: Sequence[float]) -> float:
        """This rank's share of the step loss, summed over every rank by the trainer."""
        total = 0.0
        for x in micro_losses:
            total += x
        return total

    def step_stats(self) -> list[float]:
        """This rank's share of the recipe's statistics (summed over every rank)."""
        return []

    def metrics(self, stats: np.ndarray) -> dict[str, float]:
        """Extra metrics of the step from the summed `step_stats` (default: none)."""
        return {}

    # -- evaluation -------------------------------------------------------------------------

    def build_eval_data(self, path: str) -> StepSource:
        """The eval set at `path` as a source of ONE row per `next_step()` (a list holding one
        one-row batch), the same rows on every rank: this recipe's data source (same format,
        tokenizer, packing, seq_len) on `path` in file order, built as for one dp rank with
        `data.micro_batch_size` = `train.grad_accum` = 1 (the trainer's evaluator deals the
        rows to the dp ranks itself, so a pass ends exactly at the set's end)."""
        cfg = self.cfg
        eval_cfg = replace(
            cfg,
            data=replace(cfg.data, path=path, shuffle=False, micro_batch_size=1),
            train=replace(cfg.train, grad_accum=1),
        )
        ctx = SingleRowContext(**{f.name: getattr(self.ctx, f.name) for f in fields(self.ctx)})
        return type(self)(replace(ctx, cfg=eval_cfg)).build_data()

    def eval_sums(
        self, batches: list[Any], runner: PipelineRunner, module: paddle.nn.Layer
    ) -> list[float]:
        """This rank's share of the sums `eval_metrics` needs, for one eval batch (the trainer
        sums them over every rank and every eval batch). Forward-only passes only."""
        raise NotImplementedError(f"recipe {self.name!r} has no evaluation")

    def eval_metrics(self, sums: np.ndarray) -> dict[str, float]:
        """Eval metrics (without the `eval/` prefix) from the summed `eval_sums`."""
        raise NotImplementedError(f"recipe {self.name!r} has no evaluation")
