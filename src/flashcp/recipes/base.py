"""The recipe interface: what a training recipe supplies, as functions of their inputs.

The trainer (`flashcp.trainer.Trainer`) owns everything recipes share: process groups, the
model and its parallelisms (`flashcp.parallelize`), cutting each FULL batch into this rank's
micro-batch (`flashcp.pipeline.runner.MicroBatch.of`: its cp shard, via `flashcp.cp.shard`),
the optimizer, gradient synchronisation, clipping, non-finite handling, checkpoints and the
metrics file. A recipe owns what differs, and keeps no per-step state:

* `data(path=None)`: the step source (`next_step()` gives this dp rank's micro-batches of FULL
  sequences, labels shifted, global mask built; `state_dict()` / `load_state_dict()` resume
  it; `balance_metrics()` the last step's modelled `balance/...` imbalance,
  `flashcp.data.balance`); with a `path`, the eval set there, one row per `next_step()`;
* `setup(model)`: recipe business on this rank's parallelized stage (DPO: the frozen
  reference copy, of the stage only);
* `count(batches)`: this dp rank's share of the step's loss normaliser and target tokens, from
  the FULL batches; the trainer sums it over dp and divides every micro-batch's loss by the
  normaliser (`normalised`), so the losses of all ranks add up to the mean loss of one big
  batch whatever the dp / pp / cp layout;
* `prepare(micro, runner)`: forward-only passes the loss needs first (DPO reference log-probs),
  attached to each micro-batch's `payload` on the last pipeline stage;
* `loss(out, mb) -> (loss, stats)`: the micro-batch's SUMMED loss from the last stage's output
  `out` (a `flashcp.models.HeadInput`: final-norm hidden states with the stage as LM head;
  recipes never see full logits, they call `out.token_logprobs(labels, chunk_tokens=...)`),
  and its statistics, one number per name in `stats`. Training back-propagates the loss;
  evaluation runs the same function forward only and keeps the statistics;
* `finish(sums) -> metrics`: the metrics from `stats` summed over every micro-batch and rank —
  one function for both: a training step's record carries the `step_metrics` among them, an
  evaluation all of them (as `eval/...`).

A `replicated` recipe computes the same loss and statistics on every cp rank (DPO, from
cp-summed answer log-probs): only cp rank 0's enter the job's sums (`counted`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, ClassVar, Protocol

import paddle

from flashcp.config import IGNORE_INDEX, Config
from flashcp.data.peers import Peers
from flashcp.distributed import ParallelGroups, all_gather_object, resolve_timeout
from flashcp.models import HeadInput
from flashcp.pipeline.runner import LossFn, MicroBatch, PipelineRunner


class StepSource(Protocol):
    """A recipe's data: this dp rank's micro-batches per step, resumable."""

    @property
    def seq_len(self) -> int: ...

    def next_step(self) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def describe(self) -> str: ...

    def balance_metrics(self) -> dict[str, float]: ...


def data_peers(groups: ParallelGroups) -> Peers:
    """Every rank of the job, to index the data rows together (`flashcp.data.index`); a rank
    waits the start-up timeout for the others (tokenizing a large share can take minutes)."""
    world = groups.world
    timeout = resolve_timeout(startup=True)
    gather = partial(all_gather_object, group=world, timeout=timeout)
    return Peers(rank=int(world.rank), size=int(world.nranks), gather=gather)


def eval_config(cfg: Config, path: str) -> Config:
    """`cfg` reading the eval set at `path` one row at a time, in file order."""
    return replace(
        cfg,
        data=replace(cfg.data, path=path, shuffle=False, micro_batch_size=1),
        train=replace(cfg.train, grad_accum=1),
    )


def normalised(
    loss: Callable[[HeadInput, MicroBatch], tuple[paddle.Tensor, Any]], denom: float
) -> LossFn:
    """The runner's loss function of a step: `loss` (a recipe's summed loss and its stats)
    divided by the step's GLOBAL normaliser `denom`."""

    def step_loss(out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, Any]:
        value, stats = loss(out, mb)
        return value / denom, stats

    return step_loss


class Recipe:
    """Base recipe (see the module docstring): subclasses name their data class, `stats` and
    `step_metrics`, and define `loss` and `finish`."""

    name: ClassVar[str] = ""
    data_class: ClassVar[Callable[..., StepSource]]
    """Builds the step source: `(cfg, dp_rank=, dp_size=, peers=, one_pass=)`."""
    stats: ClassVar[tuple[str, ...]] = ()
    """The names of the numbers `loss` returns beside the loss, summed by the trainer."""
    step_metrics: ClassVar[tuple[str, ...]] = ()
    """The metrics of `finish` a training step's record carries (its loss and target count
    are the step's own)."""
    replicated: ClassVar[bool] = False
    """Whether every cp rank computes the same loss and statistics (cp rank 0's count)."""

    def __init__(self, cfg: Config, groups: ParallelGroups) -> None:
        self.cfg = cfg
        self.groups = groups

    def data(self, path: str | None = None) -> StepSource:
        """The step source of this dp rank; with `path`, the eval set at `path` as a source of
        ONE row per `next_step()` (a list holding one one-row batch), the same rows on every
        rank: this recipe's data (format, tokenizer, packing, seq_len) on `path` in file order,
        built as for one dp rank (the evaluator deals the rows to the dp ranks itself, so a
        pass ends exactly at the set's end), each document once and whole (`one_pass`)."""
        cfg, dp_rank, dp_size = self.cfg, int(self.groups.dp.rank), int(self.groups.dp.nranks)
        if path is not None:
            cfg, dp_rank, dp_size = eval_config(cfg, path), 0, 1
        return self.data_class(cfg, dp_rank=dp_rank, dp_size=dp_size, peers=data_peers(self.groups),
                               one_pass=path is not None)  # fmt: skip

    def setup(self, model: paddle.nn.Layer) -> None:
        """Recipe business on this rank's parallelized stage before training (default: none)."""

    def count(self, batches: Sequence[Any]) -> tuple[float, float]:
        """(loss normaliser, target tokens) of this dp rank's FULL `batches`; the trainer sums
        both over dp. Default: the target tokens (labels other than `IGNORE_INDEX`) twice."""
        targets = float(sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches))
        return targets, targets

    def prepare(self, micro: Sequence[MicroBatch], runner: PipelineRunner) -> None:
        """Forward-only work the loss needs, attached to `micro` (default: none)."""

    def loss(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, list[Any]]:
        """The micro-batch's summed loss and its `stats` (floats or 0-D tensors)."""
        raise NotImplementedError(f"recipe {self.name!r} defines no loss")

    def finish(self, sums: Sequence[float]) -> dict[str, float]:
        """Metrics from the summed `stats` (training keeps the `step_metrics` of them)."""
        raise NotImplementedError(f"recipe {self.name!r} defines no metrics")

    def counted(self) -> bool:
        """Whether this rank's loss and stats enter the job's sums: every rank's, or cp rank
        0's alone for a `replicated` recipe (the others computed the same values)."""
        return not self.replicated or int(self.groups.cp.rank) == 0
