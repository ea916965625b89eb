"""The training loop: one `Trainer` per process, the same code for 1 or N ranks.

Each rank builds only its part of the model — its pipeline stage (the whole model when
pp = 1), directly in `train.param_dtype` — and writes what it built to `run_info.json`
(`flashcp.metrics.run_info`) at the start of `fit`.

One optimizer step (`Trainer.train_step`):

1. The recipe's data (`flashcp.recipes.base.Recipe.build_data`) gives this dp rank's
   `grad_accum` micro-batches of FULL sequences (labels shifted, global FlashMask built).
2. The recipe plans the step (`Recipe.plan`): each micro-batch sharded to this cp rank (the
   step's `Assignment`; for `workload_balanced` computed from the batch's global mask), with a
   loss closure normalised by a GLOBAL count (the step's target tokens for pretrain/sft, its
   preference pairs for DPO), so the job's loss and gradients are those of one big batch
   whatever the dp / pp / cp layout. Forward-only passes the loss needs (DPO reference
   log-probs) run next (`Recipe.prepare`).
3. The runner (`flashcp.pipeline.runner.PipelineRunner`) runs forward, loss and backward per
   micro-batch under the 1F1B / GPipe schedule on this rank's stage (the losses live on the
   last stage); at pp = 1 the whole model is one stage: one micro-batch after the other.
4. The loss, the recipe's statistics and per-rank non-finite flags are all-reduced (cp, dp,
   pp); the gradients are summed (bucketed all-reduce) over cp, then dp - or, under
   `parallel.shard_optimizer`, reduce-scattered so each rank keeps its shard's sum
   (`flashcp.optim.zero`).
5. NaN/Inf: `train.on_nonfinite: stop` raises `NonFiniteError` naming the step and rank(s) on
   every rank at once; `skip` drops the update and logs it.
6. AdamW step (clipping the global gradient norm; over every pipeline stage when pp > 1) on
   the parameters, or on float32 master weights (bf16-stored parameters; this rank's shard
   under ZeRO-1, all-gathered into the parameters after), LR schedule step, metrics on rank 0,
   checkpoint every `checkpoint.every` steps.
7. MoE models: the routers' expert loads (and dropped entries, balance-loss values) ride in
   step 4's all-reduce; after an applied step the correction biases move toward the
   under-loaded experts (`model.router_bias_update_rate`), and the summarised loads go to the
   metrics (`flashcp.metrics.moe_stats`).

After a step, every `eval.every` steps and after the last, the eval set runs forward only
under the same layout (`flashcp.evaluate`); its `eval/...` metrics join the step's
record, which rank 0 writes to metrics.jsonl and every `run.report_to` backend
(`flashcp.metrics.tracking`), with `mfu` (`flashcp.metrics.flops`) and `consumed_tokens`.

Only trainable parameters are optimised, synchronised and checkpointed: with a `lora` section
those are the adapters (saved in PaddleFormers' format). Every checkpoint read and write, and
the exports at the end of a LoRA run, go through `flashcp.checkpoint.checkpointer.Checkpointer`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import paddle

from flashcp import rundir
from flashcp.attention.registry import make_assignment
from flashcp.checkpoint.checkpointer import Checkpointer
from flashcp.checkpoint.experts import ExpertArrays
from flashcp.config import Config, to_yaml
from flashcp.cp.layout import Assignment
from flashcp.distributed import ParallelDims, ParallelGroups, barrier, build_groups
from flashcp.evaluate import Evaluator, ep_lockstep, format_eval, is_due
from flashcp.metrics import flops, memory, tracking
from flashcp.metrics.moe_stats import RouterStats
from flashcp.metrics.run_info import write_run_info
from flashcp.metrics.writer import MetricsWriter, StepMetrics
from flashcp.models.base import StageSpec
from flashcp.models.expert_parallel import attach_exchange
from flashcp.models.moe_balance import loss_scale_context
from flashcp.optim.grads import all_reduce_values, trainable
from flashcp.optim.lr import build_scheduler
from flashcp.optim.zero import MasterOptimizer, build_distributed_optimizer
from flashcp.pipeline.runner import PipelineRunner
from flashcp.pipeline.stage import stage_spec
from flashcp.recipes.base import Recipe, RecipeContext

START_BARRIER_TIMEOUT = 3600.0
"""Ranks wait this long (s) at the start of `fit` for the slowest one to build and resume."""


class NonFiniteError(RuntimeError):
    """NaN/Inf in the loss or gradients (train.on_nonfinite: stop)."""


@dataclass
class TrainResult:
    """What `Trainer.fit` did."""

    start_step: int
    final_step: int
    metrics: list[StepMetrics] = field(default_factory=list)
    resumed_from: Path | None = None


def resolve_device(cfg: Config) -> str:
    """`cpu` or `gpu` for `run.device` (auto: GPU when Paddle sees one); checks the dtype."""
    has_gpu = bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
    wanted = cfg.run.device
    if wanted == "gpu" and not has_gpu:
        raise RuntimeError(
            "run.device is gpu but Paddle sees no GPU here (CPU build or no device): set "
            "run.device: cpu (or auto)"
        )
    device = "gpu" if wanted == "gpu" or (wanted == "auto" and has_gpu) else "cpu"
    resolve_dtype(cfg, device)
    return device


def resolve_dtype(cfg: Config, device: str) -> str:
    """The compute dtype on `device`: `train.dtype`, with auto = bfloat16 on GPU, float32 on CPU.

    float32 on a GPU is refused: Paddle's FlashAttention/FlashMask CUDA kernels are registered
    for float16/bfloat16 only, so the first attention call would fail.
    """
    dtype = cfg.train.dtype
    if dtype == "auto":
        return "bfloat16" if device == "gpu" else "float32"
    if dtype == "bfloat16" and device != "gpu":
        raise RuntimeError(
            "train.dtype bfloat16 needs a GPU and this run is on CPU: set train.dtype=float32 "
            "(or auto)"
        )
    if dtype == "float32" and device == "gpu":
        raise RuntimeError(
            "train.dtype float32 cannot run on this GPU: Paddle's FlashAttention/FlashMask "
            "kernels exist for float16/bfloat16 only. Set train.dtype=auto (bfloat16 on GPU) "
            "or bfloat16, or run.device=cpu"
        )
    return dtype


def seed_rngs(cfg: Config) -> None:
    """Seed Python, numpy and Paddle from `train.seed`. The deterministic runtime flags are the
    process's, set by its entry before the trainer is built (`flashcp.launch.worker`)."""
    seed = cfg.train.seed
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


def default_model_factory(cfg: Config, stage: StageSpec | None = None) -> paddle.nn.Layer:
    """Build the configured model — only pipeline stage `stage` of it when given — directly in
    `train.param_dtype`, initialised from `train.seed` (`flashcp.models.build_model`), or
    with `checkpoint.init_from` filled from that checkpoint instead (every parameter is read
    from it, so none is drawn first)."""
    from flashcp.models import build_model

    model = build_model(
        cfg.model,
        stage=stage,
        param_dtype=cfg.train.param_dtype,
        seed=cfg.train.seed,
        initialise=cfg.checkpoint.init_from is None,
    )
    init_weights(model, cfg)
    return model


def init_weights(model: paddle.nn.Layer, cfg: Config, *, on_tensor: Any = None) -> Any:
    """Load the HF-layout weights named by `checkpoint.init_from`, if any (strict keys/shapes).

    `model` is the whole model or one pipeline stage: a stage reads only its own tensors.
    `on_tensor` and the returned `LoadReport` (None without init_from): see
    `flashcp.models.hf_weights.load_hf_checkpoint`.
    """
    if cfg.checkpoint.init_from is None:
        return None
    from flashcp.models.hf_weights import load_hf_checkpoint

    return load_hf_checkpoint(model, cfg.checkpoint.init_from, on_tensor=on_tensor)


def build_recipe(ctx: RecipeContext) -> Recipe:
    """The recipe object of `run.recipe` (see `flashcp.recipes`)."""
    from flashcp.recipes.lm import LMRecipe, SFTRecipe

    name = ctx.cfg.run.recipe
    if name == "dpo":
        from flashcp.recipes.dpo import DPORecipe

        return DPORecipe(ctx)
    classes: dict[str, type[Recipe]] = {"pretrain": LMRecipe, "sft": SFTRecipe}
    if name not in classes:
        raise ValueError(f"run.recipe {name!r} has no trainer recipe")
    return classes[name](ctx)


class Trainer:
    """Trains `cfg` on this process's share of the job (see the module docstring).

    `groups` are this rank's process groups (None: a single process, trivial groups).
    `model_factory(cfg, stage)` builds this rank's part of the model: pipeline stage `stage`
    (a `flashcp.models.StageSpec`; the whole model when pp = 1) and nothing else — no rank ever
    holds the full model (tests pass small stand-ins). Initial values depend on (train.seed,
    parameter name) only, so each stage starts from exactly the weights one process would
    have. `self.model` is this rank's module (a `CausalLM`: the whole model, or its stage) and
    `self.params` its trainable `(name, parameter)` pairs.
    """

    def __init__(
        self,
        cfg: Config,
        groups: ParallelGroups | None = None,
        *,
        model_factory: Any = None,
        stream: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        if groups is None:
            if cfg.parallel.world_size != 1:
                raise ValueError(
                    f"parallel degrees {cfg.parallel.dp}×{cfg.parallel.pp}×{cfg.parallel.cp} "
                    "need a launched job: run with `flashcp train` or paddle.distributed.launch"
                )
            groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
        self.groups = groups
        self.rank = int(groups.rank)
        self.is_main = self.rank == 0
        self.cp_rank, self.cp_size = int(groups.cp.rank), int(groups.cp.nranks)
        self.dp_rank, self.dp_size = int(groups.dp.rank), int(groups.dp.nranks)
        self.pp_rank, self.pp_size = int(groups.pp.rank), int(groups.pp.nranks)
        self.ep_rank, self.ep_size = int(groups.ep.rank), int(groups.ep.nranks)
        if self.ep_size != cfg.parallel.ep:
            raise ValueError(
                f"parallel.ep={cfg.parallel.ep} but the process groups were built with ep="
                f"{self.ep_size}: build them from the same config (ParallelDims(..., ep=...))"
            )
        self.step_groups = [groups.cp, groups.dp, groups.pp]
        """Step statistics (loss, flags, recipe sums) are summed over these."""
        self.output_dir = Path(cfg.run.output_dir)
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        """The compute dtype (`train.dtype` resolved: auto = bfloat16 on GPU, float32 on CPU)."""
        paddle.set_device(self._device_name())
        seed_rngs(cfg)
        ctx = RecipeContext(
            cfg=cfg, groups=groups, assignment_for=self.assignment_for, dtype=self.dtype
        )
        self.recipe = build_recipe(ctx)
        self.data = self.recipe.build_data()
        spec = stage_spec(cfg.model, self.pp_rank, self.pp_size, cfg.parallel.pp_layers)
        self.spec = dataclasses.replace(spec, ep_rank=self.ep_rank, ep_size=self.ep_size)
        """This rank's pipeline stage (the whole model when pp = 1), with its ep rank's share
        of the routed experts (`parallel.ep`)."""
        self.model = (model_factory or default_model_factory)(cfg, self.spec)
        if self.ep_size > 1:
            attach_exchange(self.model, groups.ep_exchange())
        self.model.train()
        self.router: RouterStats | None = None
        """Expert-load statistics and the router bias update (MoE models only)."""
        if getattr(cfg.model, "arch", None) == "glm_moe":
            self.router = RouterStats(self.model, cfg.model)
        self.recipe.setup_model(self.model)
        self.lora = self.recipe.lora
        """`flashcp.lora.setup.LoRASetup` when a `lora` section is set, else None."""
        self.params = trainable(self.model)
        self.scheduler = build_scheduler(cfg.train)
        self.optimizer = build_distributed_optimizer(
            self.model,
            cfg.train,
            self.scheduler,
            groups,
            shard=cfg.parallel.shard_optimizer,
            shard_gradients=cfg.parallel.shard_gradients,
            bucket_bytes=int(cfg.parallel.grad_bucket_mb * 2**20),
        )
        """This rank's optimizer (`flashcp.optim.zero`): Paddle's AdamW on the parameters,
        or on float32 master weights (bf16 storage), sharded under parallel.shard_optimizer."""
        self.checkpointer = Checkpointer(
            cfg,
            groups,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data=self.data,
            experts=ExpertArrays(self.model, groups),
            lora=self.lora,
            echo=self.echo,
        )
        """Every checkpoint read and write of this rank, and the LoRA exports."""
        self.checkpointer.init_masters()
        self.runner = PipelineRunner(
            self.model,  # type: ignore[arg-type]
            groups,
            kind=cfg.parallel.pp_schedule,
            forward_context=ctx.autocast,
        )
        self.step = 0
        self.consumed_tokens = 0
        """Tokens (padding included) the whole job has trained on, counting resumed steps."""
        self.stream = stream
        self.evaluator: Evaluator | None = None
        """Held-out evaluation (`eval.path`; `flashcp.evaluate`), None without."""
        if cfg.eval.path is not None:
            self.evaluator = Evaluator(
                self.recipe,
                cfg.eval.path,
                max_batches=cfg.eval.max_batches,
                groups=self.step_groups,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                rows_per_rank=cfg.train.grad_accum * cfg.data.micro_batch_size,
                lockstep=ep_lockstep(self.ep_size, self.cp_size),
            )
        self.flops_per_token = flops.flops_per_token(
            cfg.model,
            self.data.seq_len,
            lora=self.lora is not None,
            reference=cfg.run.recipe == "dpo",
        )
        """Model FLOPs of one trained token (`flashcp.metrics.flops`), for the `mfu` metric."""

    def _device_name(self) -> str:
        if self.device == "cpu":
            return "cpu"
        current = str(paddle.get_device())
        return current if current.startswith("gpu") else "gpu"

    # -- checkpoints --------------------------------------------------------------------------

    def resume(self) -> Path | None:
        """Load the checkpoint `checkpoint.resume` selects, if any; returns its path."""
        # the check `flashcp train` and every rank made before; here for in-process use
        rundir.check_start(self.cfg.run.output_dir, self.cfg.checkpoint.resume,
                           self.cfg.run.overwrite)  # fmt: skip
        resumed = self.checkpointer.resume(self.global_batch()["tokens"])
        if resumed is None:
            return None
        self.step, self.consumed_tokens = resumed.step, resumed.consumed_tokens
        return resumed.path

    # -- one step ---------------------------------------------------------------------------

    def assignment_for(self, batch: Any) -> Assignment:
        """The step's CP layout, as the registry's mode makes it (fixed, or from the mask)."""
        mode, mask = self.cfg.parallel.cp_mode, batch.mask
        return make_assignment(mode, self.cp_size, mask.indices, causal=mask.causal)

    def train_step(self) -> StepMetrics:
        """Run one optimizer step (see the module docstring); returns its metrics."""
        start = time.perf_counter()
        step = self.step + 1
        plan = self.recipe.plan(self.data.next_step())
        self.recipe.prepare(plan, self.runner, self.model)
        # the sequence-balance loss of MoE layers: a mean over the step's sequences
        with loss_scale_context(1.0 / (len(plan.micro) * self.dp_size)):
            loss_local = self.recipe.loss_value(self.runner.train(plan.micro))
        grads_finite = math.isfinite(self.optimizer.local_squares())
        world = int(self.groups.world.nranks)
        stats = self.recipe.step_stats()
        routing = self.router.local_vector() if self.router is not None else np.zeros(0)
        # one all-reduce: loss, per-rank non-finite flags, per-rank memory peaks, recipe sums,
        # expert loads
        base = 1 + 4 * world
        flags = np.zeros(base + len(stats) + len(routing))
        flags[0] = loss_local
        flags[1 + self.rank] = 0.0 if math.isfinite(loss_local) else 1.0
        flags[1 + world + self.rank] = 0.0 if grads_finite else 1.0
        flags[1 + 2 * world + self.rank] = memory.peak_bytes()
        flags[1 + 3 * world + self.rank] = memory.peak_rss_bytes()
        flags[base : base + len(stats)] = stats
        flags[base + len(stats) :] = routing
        reduced = all_reduce_values(flags, self.step_groups)
        loss_value = float(reduced[0])
        bad_loss = [r for r in range(world) if reduced[1 + r] > 0]
        bad_grad = [r for r in range(world) if reduced[1 + world + r] > 0]
        peaks = reduced[1 + 2 * world : 1 + 3 * world]
        peak_rank = int(np.argmax(peaks))
        peak_rss = float(np.max(reduced[1 + 3 * world : 1 + 4 * world]))
        extra = self.recipe.metrics(reduced[base : base + len(stats)])
        if self.router is not None:
            extra.update(self.router.metrics(reduced[base + len(stats) :]))
        lr = float(self.scheduler.get_lr())
        skipped = False
        if bad_loss or bad_grad:
            self._nonfinite(step, loss_value, bad_loss, bad_grad)
            skipped = True
            grad_norm = float("nan")
        else:
            self.optimizer.reduce_grads()
            grad_norm = self.optimizer.grad_norm()
            if self.cfg.debug.dump_grads:
                self.checkpointer.dump_grads(step, self.optimizer.full_grads)
            self.optimizer.step()
            if self.router is not None:  # after the update, from the step's summed loads
                self.router.update_biases(reduced[base + len(stats) :])
        self.optimizer.clear_grad()
        self.scheduler.step()
        self.step = step
        self.consumed_tokens += plan.tokens
        elapsed = time.perf_counter() - start
        tokens_per_s = plan.tokens / elapsed if elapsed > 0 else 0.0
        return StepMetrics(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            tokens=plan.tokens,
            targets=plan.targets,
            tokens_per_s=tokens_per_s,
            step_time_s=elapsed,
            peak_memory_gib=float(peaks[peak_rank]) / 2**30,
            peak_memory_rank=peak_rank,
            peak_rss_gib=peak_rss / 2**30,
            skipped=skipped,
            extra=extra,
            consumed_tokens=self.consumed_tokens,
            mfu=self._mfu(tokens_per_s),
        )

    def _mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation of the step (None without `hardware.peak_tflops`)."""
        peak = self.cfg.hardware.peak_tflops
        if peak is None:
            return None
        devices = int(self.groups.world.nranks)
        return flops.mfu(self.flops_per_token, tokens_per_s, peak, devices)

    def evaluate(self) -> dict[str, float]:
        """Evaluate on `eval.path` now (collective); returns the `eval/...` metrics."""
        if self.evaluator is None:
            raise ValueError("no eval set: set eval.path")
        return self.evaluator.run(self.runner, self.model)

    def _nonfinite(self, step: int, loss: float, bad_loss: list[int], bad_grad: list[int]) -> None:
        parts = []
        if bad_loss:
            parts.append(f"loss on rank(s) {', '.join(map(str, bad_loss))}")
        if bad_grad:
            parts.append(f"gradients on rank(s) {', '.join(map(str, bad_grad))}")
        what = " and ".join(parts)
        if self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {what} at step {step} (loss {loss}); stopping. Lower train.lr, "
                "check the data, or set train.on_nonfinite=skip to drop such steps"
            )
        self.echo(f"warning: non-finite {what} at step {step}: update skipped")

    # -- the run ----------------------------------------------------------------------------

    def echo(self, text: str) -> None:
        if self.is_main:
            print(text, file=self.stream, flush=True)

    def describe(self) -> str:
        c = self.cfg
        n = sum(int(np.prod(p.shape)) for _, p in self.params)
        what = "trainable parameters (LoRA adapters)" if self.lora is not None else "parameters"
        stage = ""
        if self.pp_size > 1:
            r = self.model.layer_range  # type: ignore[attr-defined]
            stage = f", stage 0 layers [{r.start}, {r.stop}) {c.parallel.pp_schedule}"
        b = self.global_batch()
        masters = isinstance(self.optimizer, MasterOptimizer)
        return (
            f"flashcp {c.run.recipe}: {c.model.arch} model, {n / 1e6:.2f}M {what} on rank 0 | "
            f"dp={self.dp_size} pp={self.pp_size} cp={self.cp_size}"
            + (f" ep={self.ep_size}" if self.ep_size > 1 else "")
            + f" ({c.parallel.cp_mode}"
            f"{stage}) | global batch {b['sequences']} seq × {b['seq_len']} = "
            f"{b['tokens']:,} tokens/step (micro-batch {b['micro_batch_size']} × accum "
            f"{b['grad_accum']} × dp {b['dp']}) | {self.device} {self.dtype} | "
            f"{self.data.describe()}"
            + (f" | {self.optimizer.describe()}" if masters else "")
            + f" | {self._describe_extras()}"
        )

    def _describe_extras(self) -> str:
        """MFU basis and evaluation, for the start line."""
        c = self.cfg
        peak = c.hardware.peak_tflops
        parts = [
            f"reporting to {tracking.describe(c.run.report_to)}",
            f"mfu vs {peak:g} TFLOP/s per device ({self.flops_per_token / 1e9:.3g} GFLOP/token)"
            if peak is not None
            else "mfu not reported (set hardware.peak_tflops)",
        ]
        if self.evaluator is not None:
            when = f"every {c.eval.every} steps and " if c.eval.every else ""
            parts.append(
                f"eval {c.eval.path}: {self.evaluator.rows} rows in {self.evaluator.batches} "
                f"batches {when}after step {c.train.steps}"
            )
        return " | ".join(parts)

    def global_batch(self) -> dict[str, int]:
        """What one optimizer step consumes, the whole job: `sequences` = micro_batch_size ×
        grad_accum × dp (packed rows for DPO) of `seq_len` tokens, `tokens` their product
        (padding included); with the three factors."""
        c = self.cfg
        sequences = c.data.micro_batch_size * c.train.grad_accum * self.dp_size
        seq_len = int(self.data.seq_len)
        return {
            "sequences": sequences,
            "seq_len": seq_len,
            "tokens": sequences * seq_len,
            "micro_batch_size": c.data.micro_batch_size,
            "grad_accum": c.train.grad_accum,
            "dp": self.dp_size,
        }

    def fit(self) -> TrainResult:
        """Resume if configured, then train until `train.steps`; returns what ran."""
        cfg = self.cfg
        source = self.resume()
        start = self.step
        # Every rank has checked the run directory (`resume`) before rank 0 writes to it.
        barrier(self.groups.world, timeout=START_BARRIER_TIMEOUT)
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(to_yaml(cfg))
        write_run_info(self)
        self.echo(self.describe())
        if source is not None:
            self.echo(f"resumed from {source} at step {start}")
        writer = MetricsWriter(
            self.output_dir,
            enabled=self.is_main,
            total_steps=cfg.train.steps,
            log_every=cfg.train.log_every,
            start_step=start,
            stream=self.stream,
            reporters=tracking.build_reporters(cfg) if self.is_main else (),
        )
        result = TrainResult(start_step=start, final_step=start, resumed_from=source)
        every = cfg.checkpoint.every
        end = end_all = cfg.train.steps
        if cfg.run.stop_after_steps:
            end = min(end, start + cfg.run.stop_after_steps)
        try:
            while self.step < end:
                m = self.train_step()
                results = {}
                if self.evaluator is not None and is_due(self.step, cfg.eval.every, end_all):
                    results = self.evaluate()
                    m.extra.update(results)  # the step's record carries its eval/... values
                writer.log(m)
                if results:
                    writer.echo(format_eval(self.step, results))
                result.metrics.append(m)
                result.final_step = self.step
                if every > 0 and (self.step % every == 0 or self.step == end):
                    path = self.checkpointer.save(self.step, self.consumed_tokens)
                    if path is not None:
                        writer.echo(f"saved checkpoint {path}")
            if self.lora is not None and self.step >= cfg.train.steps:
                self._finish_lora(writer)
        finally:
            writer.close()
        return result

    def _finish_lora(self, writer: MetricsWriter) -> None:
        """Export the adapters (and the merged model when `lora.merge_at_end`)."""
        out = self.checkpointer.export_adapters()
        writer.echo(f"saved LoRA adapters (PaddleFormers format) to {out}")
        section = self.cfg.extras["lora"]
        if section.merge_at_end and out is not None:
            merged = self.checkpointer.export_merged()
            writer.echo(f"saved the merged model to {merged}")
