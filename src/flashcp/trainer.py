"""The training loop: one `Trainer` per process, the same code for 1 or N ranks.

Build: the recipe and its data; this rank's stage of the model (its ep share of the experts),
parallelized (`flashcp.parallelize`) and handed to the recipe's `setup`; the optimizer, the
`Checkpointer`, the runner and the evaluator. One step (`train_step`): the data's FULL
sequences → `Recipe.count` (the global normaliser) → the runner's cp shards and
`Recipe.prepare` → forward, loss, backward under the pipeline schedule → one all-reduce of the
step's numbers (`flashcp.metrics.step_sums`) → non-finite stop/skip, or reduce, clip by the
one global norm and step AdamW → metrics, eval and checkpoints when due. The walk-through,
module by module: docs/architecture.md ("One step, end to end", "The trainer, recipes and
parallelize").

Long jobs: the step's exchange also carries each rank's pre-emption request (`stop`, set by
a signal: `flashcp.launch.preempt`) and its compute time; at the step boundary the loop asks
"stop now?" (every rank gets the same answer from the exchange) and then saves and returns
`preempted`. Compute times name stragglers (`flashcp.metrics.straggler`); rank 0 keeps the
goodput ledger (`flashcp.metrics.goodput`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import paddle

from flashcp import runstart
from flashcp.attempt import current as current_attempt
from flashcp.checkpoint.checkpointer import Checkpointer
from flashcp.checkpoint.experts import ExpertArrays
from flashcp.checkpoint.saving import STALL, SaveReport
from flashcp.config import Config, to_yaml
from flashcp.cp.balance import imbalance
from flashcp.data.epochs import epoch_steps
from flashcp.distributed import ParallelGroups, barrier, startup_phase, waited_seconds
from flashcp.evaluation.evaluator import format_eval, run_if_due, training_evaluator
from flashcp.metrics import memory, tracking
from flashcp.metrics.goodput import Goodput
from flashcp.metrics.moe_stats import RouterStats
from flashcp.metrics.step_sums import StepSums
from flashcp.metrics.straggler import StragglerWatch
from flashcp.metrics.writer import MetricsWriter, StepMetrics, layout_text
from flashcp.models.base import StageSpec
from flashcp.models.expert_parallel import expert_tensors
from flashcp.models.moe_balance import loss_scale_context
from flashcp.models.offload import take_host_peak
from flashcp.optim.grads import all_reduce_values, trainable
from flashcp.optim.lr import build_scheduler
from flashcp.optim.master_optimizer import MasterOptimizer
from flashcp.optim.optimizer import build_distributed_optimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.optim.trainable import RowSlice
from flashcp.parallelize import build_runner, build_stage
from flashcp.preemption import GraceCheck, planned_grace_warning, stop_message
from flashcp.rank_setup import process_groups, resolve_runtime, seed_rngs, step_groups, use_device
from flashcp.recipes import build_recipe
from flashcp.recipes.base import StepSource, normalised
from flashcp.run_info import RunEnd, RunFacts, RunStart, banner, finish_run, write_run_info
from flashcp.rundir import CONFIG_FILE


class NonFiniteError(RuntimeError):
    """NaN/Inf in the loss or gradients (train.on_nonfinite: stop)."""


@dataclass
class TrainResult:
    """What `Trainer.fit` did."""

    start_step: int
    final_step: int
    metrics: list[StepMetrics] = field(default_factory=list)
    resumed_from: Path | None = None
    preempted: bool = False
    """Stopped early at a pre-emption request, after saving a checkpoint."""


def expert_rows(model: paddle.nn.Layer) -> dict[str, RowSlice]:
    """The expert-parallel parameters of `model` as the optimizer takes them: structured name
    → the rows this rank holds (`flashcp.models.expert_parallel.expert_tensors`; empty
    without expert parallelism). The optimizer knows no architecture: this is all it learns."""
    return {n: RowSlice(s.first, s.count, s.total) for n, s in expert_tensors(model).items()}


def build_optimizer(
    cfg: Config, groups: ParallelGroups, model: paddle.nn.Layer, scheduler: Any
) -> ParamOptimizer | MasterOptimizer:
    """This rank's optimizer under the config's layout, told the model's expert-parallel
    parameters (`expert_rows`)."""
    return build_distributed_optimizer(
        model, cfg.train, scheduler, groups, shard=cfg.parallel.shard_optimizer,
        shard_gradients=cfg.parallel.shard_gradients,
        bucket_bytes=int(cfg.parallel.grad_bucket_mb * 2**20), experts=expert_rows(model),
    )  # fmt: skip


class Trainer:
    """Trains `cfg` on this process's share of the job (see the module docstring).

    `groups` are this rank's process groups (None: a single process, trivial groups).
    `model_factory(cfg, stage)` builds this rank's part of the model: pipeline stage `stage`
    (a `flashcp.models.StageSpec`; the whole model when pp = 1) and nothing else — no rank ever
    holds the full model — and `data` replaces the recipe's step source (tests pass small
    stand-ins for both). Initial values depend on (train.seed, parameter name) only, so each
    stage starts from exactly the weights one process would have. `self.model` is this rank's
    module (a `CausalLM`: the whole model, or its stage). `stop()` is this rank's pre-emption
    request (0: none, else the signal's number; `flashcp.launch.preempt.StopSignals`).
    """

    @startup_phase()  # ranks build at their own pace: collectives wait the start-up timeout
    def __init__(
        self,
        cfg: Config,
        groups: ParallelGroups | None = None,
        *,
        model_factory: Callable[[Config, StageSpec], paddle.nn.Layer] | None = None,
        data: StepSource | None = None,
        stream: TextIO | None = None,
        stop: Callable[[], int] | None = None,
        start_checked: bool = False,
    ) -> None:
        self.started = time.time()
        """When this run began (its build included): `run_info.json` and the last line."""
        self.cfg, self.stream, self.start_checked = cfg, stream, start_checked
        self.stop_requested: Callable[[], int] = stop or (lambda: 0)
        self.stop_ranks: dict[int, int] = {}
        """Ranks that asked to stop, as the last step's exchange told (rank → signal)."""
        self.groups = groups = process_groups(cfg, groups)
        device, dtype = resolve_runtime(cfg)
        use_device(device)
        seed_rngs(cfg)
        self.recipe = build_recipe(cfg, groups)
        self.data = data or self.recipe.data()
        cfg = self.cfg = epoch_steps(cfg, self.data)  # train.epochs: passes over this data
        self.model, spec, lora = build_stage(cfg, groups, model_factory)
        self.model.train()
        self.router = RouterStats(self.model, cfg.model) if cfg.model.is_moe else None
        """Expert-load statistics and the router bias update (MoE models only)."""
        self.recipe.setup(self.model)
        self.scheduler = build_scheduler(cfg.train)
        self.optimizer = build_optimizer(cfg, groups, self.model, self.scheduler)
        self.checkpointer = Checkpointer(
            cfg, groups, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            data=self.data, experts=ExpertArrays(self.model, groups), lora=lora, echo=self.echo,
        )  # fmt: skip
        self.checkpointer.init_masters()
        self.runner = build_runner(cfg, groups, self.model, dtype)
        self.evaluator = training_evaluator(cfg, groups, self.recipe)
        """Held-out evaluation (`eval.path`; `flashcp.evaluation.evaluator`), None without."""
        self.facts = RunFacts.of(
            cfg, groups, device=device, dtype=dtype, layers=spec.layers, seq_len=self.data.seq_len
        )
        """Device, compute dtype, layers, global batch, FLOPs per token of this run."""
        self.stragglers = StragglerWatch.of(cfg, groups)
        self.goodput = Goodput(cfg.run.output_dir, attempt=current_attempt(),
                               enabled=int(groups.rank) == 0)  # fmt: skip
        """Rank 0's goodput ledger (`goodput.json`)."""
        self.grace = GraceCheck(cfg, lambda: self.checkpointer.saves.last_write_s)
        """Whether a pre-emption fits `run.preempt_grace_s`, judged at the first commit."""
        self.step = self.consumed_tokens = 0
        """The last step done, and the tokens (padding included) the whole job trained on."""

    @property
    def params(self) -> list[tuple[str, paddle.Tensor]]:
        """This rank's trainable `(name, parameter)` pairs."""
        return trainable(self.model)

    @property
    def last_step(self) -> int:
        """The step this run stops after: `train.steps`, or `run.stop_after_steps` beyond the
        step it starts from (read after `resume`)."""
        stop = self.cfg.run.stop_after_steps
        return min(self.cfg.train.steps, self.step + stop) if stop else self.cfg.train.steps

    def resume(self) -> Path | None:
        """Load the checkpoint `checkpoint.resume` selects, if any; returns its path. First the
        run-directory check, unless this process made it (`start_checked`: the worker did)."""
        if not self.start_checked:  # for `Trainer(cfg).fit()`; `flashcp train`'s is another process
            runstart.check_start(self.cfg.run.output_dir, self.cfg.checkpoint.resume,
                                 self.cfg.run.overwrite)  # fmt: skip
        resumed = self.checkpointer.resume(self.facts.global_batch["tokens"])
        if resumed is None:
            return None
        self.step, self.consumed_tokens = resumed.step, resumed.consumed_tokens
        return resumed.path

    def run_start(self) -> RunStart:
        """What the start line and `run_info.json` tell of this run (after `resume`)."""
        ev = self.evaluator
        return RunStart(
            cfg=self.cfg, groups=self.groups, facts=self.facts, model=self.model,
            reference=getattr(self.recipe, "reference", None), data=self.data,
            optimizer=self.optimizer, checkpoints=str(self.checkpointer.root),
            last_step=self.last_step, evaluation=None if ev is None else (ev.rows, ev.batches),
            started=self.started,
        )  # fmt: skip

    # -- one step ---------------------------------------------------------------------------

    def train_step(self) -> StepMetrics:
        """Run one optimizer step (see the module docstring); returns its metrics."""
        start, step, recipe = time.perf_counter(), self.step + 1, self.recipe
        batches = self.data.next_step()
        norm, targets = all_reduce_values(recipe.count(batches), [self.groups.dp])
        computing = time.perf_counter()  # the dp ranks left that reduction together
        waited = waited_seconds()
        micro = self.runner.micro_batches(batches)
        recipe.prepare(micro, self.runner)
        loss_fn = normalised(recipe.loss, float(max(int(round(norm)), 1)))
        # the sequence-balance loss of MoE layers: a mean over the step's sequences
        with loss_scale_context(1.0 / (len(micro) * int(self.groups.dp.nranks))):
            losses, stats = self.runner.train(micro, loss_fn)
        busy = time.perf_counter() - computing  # this rank's forward and backward
        compute = busy - (waited_seconds() - waited)  # less its waits in collectives
        sums = self._step_sums(losses, stats, busy, compute)
        self.stop_ranks = {r: int(v) for r, v in enumerate(sums["stop"]) if v}
        loss = float(sums["loss"][0])
        bad_loss, bad_grads = (np.flatnonzero(sums[k]).tolist() for k in ("bad_loss", "bad_grads"))
        finished = recipe.finish(sums["recipe"]) if recipe.step_metrics else {}
        extra = {key: finished[key] for key in recipe.step_metrics}
        extra.update(self.data.balance_metrics())  # modelled (flashcp.data.balance), measured:
        extra["balance/rank_time_max_over_mean"] = imbalance(sums["busy"])
        straggler, change = self.stragglers.observe(sums["compute"])
        if straggler is not None:
            extra.update(straggler.metrics())
        if change is not None:
            self.echo(change)
        if self.router is not None:
            extra.update(self.router.metrics(sums["routing"]))
        if "offload_host" in sums:  # the most any rank's host copies held during the step
            extra["offload/host_peak_gib"] = float(np.max(sums["offload_host"])) / 2**30
        lr, grad_norm = float(self.scheduler.get_lr()), float("nan")
        if skipped := bool(bad_loss or bad_grads):
            self._nonfinite(step, loss, bad_loss, bad_grads)
        else:
            self.optimizer.reduce_grads()
            grad_norm = self.optimizer.grad_norm()
            if self.cfg.debug.dump_grads:
                self.checkpointer.dump_grads(step, self.optimizer.full_grads)
            self.optimizer.step()
            if self.router is not None:  # after the update, from the step's summed loads
                self.router.update_biases(sums["routing"])
        self.optimizer.clear_grad()
        self.scheduler.step()
        tokens = self.facts.global_batch["tokens"]
        self.step, self.consumed_tokens = step, self.consumed_tokens + tokens
        elapsed = time.perf_counter() - start
        tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0
        peak_rank = int(np.argmax(sums["peak"]))
        return StepMetrics(
            step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens,
            targets=int(round(targets)), tokens_per_s=tokens_per_s, step_time_s=elapsed,
            peak_memory_gib=float(sums["peak"][peak_rank]) / 2**30, peak_memory_rank=peak_rank,
            peak_rss_gib=float(np.max(sums["rss"])) / 2**30, skipped=skipped, extra=extra,
            consumed_tokens=self.consumed_tokens, mfu=self.facts.mfu(tokens_per_s),
        )  # fmt: skip

    def _step_sums(
        self, losses: list[float], stats: np.ndarray | None, busy: float, compute: float
    ) -> dict[str, np.ndarray]:
        """The step's loss, per-rank non-finite flags, memory peaks, busy times (`busy`: s
        from the count's reduction to the end of backward; `compute`: that less the rank's
        waits in collectives) and pre-emption requests, the recipe's statistics and the
        routers' loads, summed over the step groups in one all-reduce (a replicated recipe's
        loss and statistics count on cp rank 0 only: `Recipe.counted`)."""
        counted = self.recipe.counted()
        loss = float(sum(losses)) if counted else 0.0
        sums = StepSums(int(self.groups.rank), int(self.groups.world.nranks))
        sums.add("loss", [loss])
        sums.per_rank("bad_loss", 0.0 if math.isfinite(loss) else 1.0)
        sums.per_rank("bad_grads", 0.0 if math.isfinite(self.optimizer.local_squares()) else 1.0)
        sums.per_rank("peak", memory.peak_bytes())
        sums.per_rank("rss", memory.peak_rss_bytes())
        sums.per_rank("busy", busy)
        sums.per_rank("compute", compute)
        sums.per_rank("stop", float(self.stop_requested()))
        if self.cfg.train.offload_activations:
            sums.per_rank("offload_host", take_host_peak())
        mine = stats if counted and stats is not None else np.zeros(len(self.recipe.stats))
        sums.add("recipe", mine)
        sums.add("routing", self.router.local_vector() if self.router is not None else [])
        return sums.all_reduce(step_groups(self.groups))

    def evaluate(self) -> dict[str, float]:
        """Evaluate on `eval.path` now (collective); returns the `eval/...` metrics."""
        if self.evaluator is None:
            raise ValueError("no eval set: set eval.path")
        return self.evaluator.run(self.runner)

    def _nonfinite(self, step: int, loss: float, bad_loss: list[int], bad_grad: list[int]) -> None:
        """Stop (`NonFiniteError`) or skip the update of a non-finite step (`on_nonfinite`)."""
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
        """Print `text` on rank 0."""
        if int(self.groups.rank) == 0:
            print(text, file=self.stream, flush=True)

    def fit(self) -> TrainResult:
        """Resume if configured, then train until `train.steps`; returns what ran."""
        cfg, main = self.cfg, int(self.groups.rank) == 0
        output_dir = Path(cfg.run.output_dir)
        with startup_phase():  # up to the first step, collectives wait the start-up timeout
            source = self.resume()
            start = self.step
            # Every rank has checked the run directory (`resume`) before rank 0 writes to it.
            barrier(self.groups.world, op="barrier after resuming")
            if main:
                output_dir.mkdir(parents=True, exist_ok=True)
                (output_dir / CONFIG_FILE).write_text(to_yaml(cfg))
            run = self.run_start()
            write_run_info(run)
        self.echo(banner(run))
        if source is not None:
            self.echo(f"resumed from {source} at step {start}")
        if main and (warning := planned_grace_warning(cfg, self.facts.device)):
            self.echo(warning)
        writer = MetricsWriter(
            output_dir, enabled=main, total_steps=cfg.train.steps, log_every=cfg.train.log_every,
            start_step=start, stream=self.stream,
            reporters=tracking.build_reporters(cfg) if main else (),
            start={"layout": layout_text(cfg), "resumed": source is not None},
        )  # fmt: skip
        result = TrainResult(start_step=start, final_step=start, resumed_from=source)
        end = self.last_step
        evaluated: dict[str, float] = {}
        failure: BaseException | None = None
        self.goodput.start(start if source is not None else None)
        try:
            while self.step < end:
                m = self.train_step()
                results = run_if_due(self.evaluator, self.runner, self.step, cfg)
                m.extra.update(results)  # the step's record carries its eval/... values
                # "stop now?": every rank has the same answer, from the step's exchange
                stopping = bool(self.stop_ranks) and self.step < end
                # every checkpoint.every steps, the last one (checkpoint.save_last), and a
                # pre-emption's
                due = cfg.checkpoint.due(self.step, end) or stopping
                saved = self._checkpoint(due, last=self.step == end or stopping)
                m.extra.update(saved.metrics)  # checkpoint/stall_s, ... of this boundary
                stall = float(saved.metrics.get(STALL, 0.0))  # the goodput ledger's step
                self.goodput.step(self.step, m.step_time_s)
                self.goodput.checkpoint(self.step if due else None, stall)
                warning = self.grace.observe(self.step, m.step_time_s, saved, due)
                m.extra.update(self.goodput.metrics())
                writer.log(m)
                if results:
                    writer.echo(format_eval(self.step, results))
                    evaluated = results
                if stopping:
                    writer.echo(stop_message(self.step, self.stop_ranks))
                for line in [*saved.messages, *([warning] if warning else [])]:
                    writer.echo(line)
                result.metrics.append(m)
                result.final_step = self.step
                if stopping:
                    result.preempted = True
                    break
            if self.step >= cfg.train.steps:  # LoRA: the adapters, and the merged model
                self.checkpointer.export_lora(writer.echo)
            self.goodput.finish(complete=self.step >= cfg.train.steps)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            writer.close()
            if main:  # how the run ended: into run_info.json, and its last line
                done = RunEnd.of(
                    cfg, started=self.started, first_step=result.start_step + 1,
                    final_step=self.step, losses=[r.loss for r in result.metrics],
                    evaluated=evaluated, failure=failure, preempted=result.preempted,
                )  # fmt: skip
                if (last := finish_run(cfg, done)) is not None:
                    self.echo(last)
        return result

    def _checkpoint(self, due: bool, *, last: bool) -> SaveReport:
        """The checkpoint's share of a step boundary (collective): save when `due`, else let
        an asynchronous save in flight commit; at the `last` step (or a pre-emption's), wait
        for it to commit."""
        ck = self.checkpointer
        report = ck.save(self.step, self.consumed_tokens) if due else ck.poll()
        return report.merge(ck.finish()) if last else report
