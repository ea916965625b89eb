"""Held-out evaluation during training (`eval.path`, `eval.every`, `eval.max_batches`).

The eval set is read like the training data (same format, tokenizer, packing and sequence
length: `Recipe.data(path)`), in file order, one row at a time, from its start at every
evaluation. An eval batch is one optimizer step's worth of rows (dp × train.grad_accum ×
data.micro_batch_size), dealt to the dp ranks (rank r takes its grad_accum × micro_batch_size
rows as one-row micro-batches) and run under the run's own layout — cp shards, pipeline
stages — through the training step's own loss and statistics (`Recipe.prepare`, then
`Recipe.loss` in FORWARD-ONLY passes through the runner, `forward_only`; its statistics are
kept), so no gradient, optimizer state, data position or RNG of training changes: a run with
eval has bitwise the training losses of the run without. The model is in eval mode meanwhile
(no adapter dropout) and the Python / numpy / Paddle RNG states are restored after.

One pass (`eval.max_batches: null`) is every row of the set exactly once: its length is
counted at the start by stepping the eval data (no model) until its state's `epoch` grows;
the last batch may be short (some dp ranks then get fewer rows, or none). `eval.max_batches`
stops earlier.

What is reported (`eval/` + the recipe's `finish` of the summed statistics), in the record of
the step it ran:

* pretrain / sft: `eval/loss` = Σ cross-entropy / Σ target tokens over the pass
  (token-weighted, counted over every dp/cp rank like training), `eval/perplexity`,
  `eval/targets`;
* dpo: `eval/loss` (mean DPO loss over the pairs), `eval/rewards/chosen`, `/rejected`,
  `/margin`, `/accuracy`, `eval/logps/chosen`, `/rejected` (the policy's mean answer log-prob
  sums), `eval/examples`, `eval/targets` (answer tokens);
* `eval/batches`, `eval/rows` and `eval/time_s`.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle

from flashcp.config import Config
from flashcp.distributed import ParallelGroups
from flashcp.models import HeadInput
from flashcp.optim.grads import all_reduce_values
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.rank_setup import step_groups
from flashcp.recipes.base import Recipe, StepSource

PREFIX = "eval/"
MAX_PASS_ROWS = 10_000_000
"""A pass longer than this many rows is refused (set eval.max_batches)."""


def data_epoch(state: Any) -> int | None:
    """The `epoch` entry of a data source's `state_dict()` (searched through nested
    mappings), or None when it has none."""
    if isinstance(state, Mapping):
        if "epoch" in state:
            return int(state["epoch"])
        for value in state.values():
            found = data_epoch(value)
            if found is not None:
                return found
    return None


def _next_epoch(state: Any) -> Any:
    """`state` with its `epoch` entry one higher: the same position one epoch later."""
    out = copy.deepcopy(state)
    node = out
    while isinstance(node, dict) and "epoch" not in node:
        node = next((v for v in node.values() if data_epoch(v) is not None), None)
    if isinstance(node, dict):
        node["epoch"] = int(node["epoch"]) + 1
    return out


def pass_rows(data: StepSource, start: Any, limit: int | None = None) -> int:
    """Rows in one pass over the one-row source `data` from `start` (the beginning of an
    epoch), at most `limit`.

    A source may turn its epoch as it hands out the last row (the state's epoch has grown
    before the next row is asked for) or only when the next row is asked for (that row is the
    next epoch's first: its end state is the first row's end state one epoch later); both end
    the pass after the set's last row.
    """
    data.load_state_dict(copy.deepcopy(start))
    first = data_epoch(start)
    first_end: Any = None
    rows = 0
    while limit is None or rows < limit:
        if data_epoch(data.state_dict()) != first:
            break
        if rows >= MAX_PASS_ROWS:
            raise ValueError(
                f"one pass over the eval set is more than {MAX_PASS_ROWS} rows: set "
                "eval.max_batches"
            )
        data.next_step()
        end = copy.deepcopy(data.state_dict())
        if first_end is None:
            first_end = end
        elif end == _next_epoch(first_end):
            break  # this row began the next epoch
        rows += 1
    return rows


def ep_lockstep(ep: int, cp: int) -> str | None:
    """Why every dp rank must run the same forward passes under expert parallelism (None: no
    need): ep groups are consecutive ranks of a stage in dp-major order, so unless cp is a
    multiple of ep an ep group holds ranks of different dp indices, which exchange tokens in
    every MoE call."""
    if ep == 1 or cp % ep == 0:
        return None
    return (
        f"parallel.ep={ep} with parallel.cp={cp} puts ranks of different dp indices in one ep group"
    )


def is_due(step: int, every: int, total: int) -> bool:
    """Whether to evaluate after `step`: every `every` steps (0: never) and after the last."""
    return step == total or (every > 0 and step % every == 0)


class Evaluator:
    """Evaluates `recipe` on the eval set at `path` (collective: every rank calls `run`).

    `dp_rank` / `dp_size` deal the rows, `rows_per_rank` (train.grad_accum ×
    data.micro_batch_size) of them to each dp rank per eval batch; `groups` are the step
    groups (cp, dp, pp) the sums are all-reduced over. `lockstep` (a reason, e.g. expert-parallel
    groups spanning dp ranks) refuses a pass whose last batch is short.
    """

    def __init__(
        self,
        recipe: Recipe,
        path: str,
        *,
        max_batches: int | None,
        groups: list[Any],
        dp_rank: int = 0,
        dp_size: int = 1,
        rows_per_rank: int = 1,
        lockstep: str | None = None,
    ) -> None:
        self.recipe = recipe
        self.path = path
        self.groups = groups
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.rows_per_rank = int(rows_per_rank)
        self.rows_per_batch = self.dp_size * self.rows_per_rank
        self.data: StepSource = recipe.data(path)
        self.start = copy.deepcopy(self.data.state_dict())
        """The eval set's first position: every evaluation starts here."""
        if max_batches is None and data_epoch(self.start) is None:
            raise ValueError(
                f"eval.max_batches is null (one pass over {path}) but the "
                f"{type(self.data).__name__} data source reports no epoch to end a pass by: "
                "set eval.max_batches"
            )
        limit = None if max_batches is None else max_batches * self.rows_per_batch
        self.rows = pass_rows(self.data, self.start, limit)
        """Rows per evaluation: one pass, or `eval.max_batches` batches of them."""
        self.batches = -(-self.rows // self.rows_per_batch)
        """Eval batches per evaluation (the last may be short)."""
        if lockstep is not None and self.rows % self.rows_per_batch:
            whole = self.rows // self.rows_per_batch
            fix = f"set eval.max_batches to at most {whole}" if whole else "add rows"
            raise ValueError(
                f"{path}: {self.rows} eval rows leave the last eval batch short (it deals "
                f"{self.rows_per_batch} rows to {self.dp_size} dp ranks), so some dp ranks would "
                f"run fewer forward passes than others; {lockstep}, whose ranks must run the same "
                f"passes: {fix}, or choose a layout whose ep groups stay inside cp groups"
            )

    def run(self, runner: PipelineRunner) -> dict[str, float]:
        """One evaluation of the runner's stage; returns the `eval/...` metrics (the same on
        every rank)."""
        started = time.perf_counter()
        rng = (random.getstate(), np.random.get_state(), paddle.get_rng_state())
        module = runner.stage
        was_training = module.training
        module.eval()
        try:
            totals = self._sums(runner)
        finally:
            if was_training:
                module.train()
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            paddle.set_rng_state(rng[2])
        reduced = all_reduce_values(totals, self.groups)
        metrics = self.recipe.finish(reduced)
        metrics["batches"] = float(self.batches)
        metrics["rows"] = float(self.rows)
        metrics["time_s"] = time.perf_counter() - started
        return {PREFIX + key: float(value) for key, value in metrics.items()}

    def _sums(self, runner: PipelineRunner) -> np.ndarray:
        """This rank's share of the recipe's statistics, summed over the eval batches."""
        self.data.load_state_dict(copy.deepcopy(self.start))
        totals: np.ndarray | None = None
        left = self.rows
        for _ in range(self.batches):
            take = min(left, self.rows_per_batch)
            left -= take
            rows = [self.data.next_step() for _ in range(take)]
            first = self.dp_rank * self.rows_per_rank
            mine = [batch for row in rows[first : first + self.rows_per_rank] for batch in row]
            micro = runner.micro_batches(mine)
            self.recipe.prepare(micro, runner)
            sums = np.zeros(len(self.recipe.stats))
            for stats in runner.forward_only(micro, self._stats) or []:
                sums += stats
            if not self.recipe.counted():
                sums[:] = 0.0
            totals = sums if totals is None else totals + sums
        assert totals is not None  # at least one row: a data source has one, max_batches >= 1
        return totals

    def _stats(self, out: HeadInput, mb: MicroBatch) -> np.ndarray:
        """The statistics of the recipe's loss of one micro-batch (no gradient)."""
        _, stats = self.recipe.loss(out, mb)
        return np.asarray([float(x) for x in stats], dtype=np.float64)


def build_evaluator(
    cfg: Config, groups: ParallelGroups, recipe: Recipe, path: str
) -> Evaluator:
    """The evaluator of `recipe` on the eval set at `path` under the run's layout (an eval
    batch is one step's rows, module docstring)."""
    return Evaluator(
        recipe, path, max_batches=cfg.eval.max_batches, groups=step_groups(groups),
        dp_rank=int(groups.dp.rank), dp_size=int(groups.dp.nranks),
        rows_per_rank=cfg.train.grad_accum * cfg.data.micro_batch_size,
        lockstep=ep_lockstep(cfg.parallel.ep, cfg.parallel.cp),
    )  # fmt: skip


def training_evaluator(cfg: Config, groups: ParallelGroups, recipe: Recipe) -> Evaluator | None:
    """The evaluator a training run runs (`run_if_due`) on `eval.path`; None without one."""
    if cfg.eval.path is None:
        return None
    return build_evaluator(cfg, groups, recipe, cfg.eval.path)


def run_if_due(
    evaluator: Evaluator | None, runner: PipelineRunner, step: int, cfg: Config
) -> dict[str, float]:
    """The `eval/...` metrics of an evaluation after training step `step` when one is due then
    (`is_due`: every `eval.every` steps and after `train.steps`), else none (nor without an
    evaluator)."""
    if evaluator is None or not is_due(step, cfg.eval.every, cfg.train.steps):
        return {}
    return evaluator.run(runner)


def format_eval(step: int, metrics: Mapping[str, float]) -> str:
    """The log line of an evaluation."""
    parts = [f"eval step {step}"]
    for key, value in metrics.items():
        name = key.removeprefix(PREFIX)
        if name in ("batches", "rows", "time_s", "targets", "examples") or "logps/" in name:
            continue
        parts.append(f"{name} {value:.4f}")
    pairs = PREFIX + "examples" in metrics
    count = metrics.get(PREFIX + ("examples" if pairs else "targets"), 0.0)
    what = "pairs" if pairs else "targets"
    parts.append(
        f"{int(metrics.get(PREFIX + 'batches', 0))} batches, {int(count):,} {what} | "
        f"{metrics.get(PREFIX + 'time_s', 0.0):.3f} s"
    )
    return " | ".join(parts)
