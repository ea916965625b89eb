"""Pipeline parallelism: the 1F1B (and GPipe) schedule over blocking send / recv.

Design decision: flashcp runs its OWN 1F1B schedule on point-to-point send / recv
(`flashcp.distributed.p2p`) rather than Paddle fleet's `PipelineLayer` / `train_batch`. Ours
composes with flashcp's CP groups (gloo groups on dedicated stores, `build_groups`) and its
watchdog timeouts and byte counters; fleet's `PipelineParallel` wants its own hybrid
communicate group, and on CPU it only ran after patching `ParallelEnv._device_id = 0` and
setting `pp_configs.use_batch_p2p_comm = False`. Our schedule's gradients are bitwise equal
to one process's on CPU (tested), and every transfer is visible to flashcp's counters.

The pure schedule logic (the order of passes and transfers per stage, and a rendezvous
simulation proving a plan deadlock-free) lives in `flashcp.pipeline.schedule`. This module
executes a plan on a `PipelineStage` (`PipelineSchedule.run` / `train_step_1f1b`).
Activations `[B, L_local, H]` and their gradients travel between ranks with the same cp (and
dp) index on adjacent stages, i.e. within `groups.pp`, over `pipeline_links` (two-rank gloo
groups when pp > 2, because of gloo's per-group tags; see `flashcp.distributed.p2p`). The
shape follows from the micro-batch's token shape and the hidden size, so only payload travels.
CP stays inside each stage: the micro-batch's `AttentionContext` carries the cp group.

Loss: the last stage returns final-norm hidden states; the schedule hands them, with the stage
as the LM head, to the loss as a `flashcp.models.HeadInput` (`out.token_logprobs(labels)`
computes log p(label) over token chunks without the full logits). The loss is a micro-batch's
own closure (`MicroBatch.loss`, what the trainer's recipes set) or `loss_fn(out, labels)` (a
SUM over this rank's target tokens) divided by `num_targets`, the GLOBAL target-token count of
the whole step (all micro-batches, all cp / dp ranks), so the micro-batch losses sum to the
single-process mean loss and the gradients match. Backward runs micro-batches in ascending
order on every stage, as a single process accumulating micro-batches one by one does: on CPU
the PP=2 gradients are bitwise equal to PP=1 (see `tests/integration/test_pipeline_multiproc.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from flashcp.distributed.collectives import broadcast_tensor, group_label
from flashcp.distributed.groups import ParallelGroups
from flashcp.distributed.p2p import pipeline_links, recv_tensor, send_tensor, swap_tensor
from flashcp.models.attention import AttentionContext
from flashcp.models.head import DEFAULT_LOSS_CHUNK_TOKENS, HeadInput
from flashcp.pipeline.schedule import (
    FORWARD,
    SCHEDULE_FNS,
    SCHEDULES,
    Op,
    ScheduleKind,
    build_plans,
    simulate_plans,
)
from flashcp.pipeline.stage import PipelineStage

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    """One micro-batch as THIS rank sees it (its cp shard when CP is on).

    `input_ids` / `positions` (GLOBAL positions) are `[B, L_local]`; `labels` `[B, L_local]`
    (already shifted on the full sequence, `-100` = no target) are needed on the last stage.
    `loss`, when set, maps the last stage's output (a `HeadInput`: final-norm hidden states
    and the stage's LM head) to this micro-batch's loss, already normalised (a recipe's own
    loss, e.g. DPO); otherwise the schedule's `loss_fn(out, labels) / num_targets` is used.
    The executors call it under the forward context (autocast), like the head it runs.
    """

    input_ids: paddle.Tensor
    positions: paddle.Tensor
    labels: paddle.Tensor | None
    attn: AttentionContext
    loss: Callable[[HeadInput], paddle.Tensor] | None = None


def sum_cross_entropy(
    out: HeadInput,
    labels: paddle.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> paddle.Tensor:
    """Cross-entropy SUMMED over the target tokens (labels == ignore_index excluded), from the
    last stage's output over chunks of `chunk_tokens` tokens (0: the full logits)."""
    logp = out.token_logprobs(labels, chunk_tokens=chunk_tokens, ignore_index=ignore_index)
    return -logp.sum()


def count_targets(labels: paddle.Tensor | np.ndarray, ignore_index: int = IGNORE_INDEX) -> int:
    """Number of target tokens in `labels` (sum this over micro-batches and ranks)."""
    arr = labels.numpy() if isinstance(labels, paddle.Tensor) else np.asarray(labels)
    return int((arr != ignore_index).sum())


LossFn = Callable[[HeadInput, paddle.Tensor], paddle.Tensor]


@dataclass
class StepState:
    """The in-flight tensors of one step on one stage, keyed by micro-batch index."""

    micro_batches: list[MicroBatch]
    loss_fn: LossFn
    num_targets: int
    plan: list[Op]
    inputs: dict[int, paddle.Tensor] = field(default_factory=dict)
    outputs: dict[int, paddle.Tensor] = field(default_factory=dict)
    grads: dict[int, paddle.Tensor] = field(default_factory=dict)
    losses: list[paddle.Tensor] = field(default_factory=list)


@dataclass
class PipelineStepResult:
    """What one step returns on every stage.

    `loss`: float32 scalar, the sum over micro-batches of this rank's normalised loss (sum it
    over cp / dp ranks for the global loss); computed on the last stage and broadcast over the
    pp group (zero elsewhere when `broadcast_loss=False`). `micro_losses`: per micro-batch,
    last stage only.
    """

    loss: paddle.Tensor
    micro_losses: list[float] = field(default_factory=list)


def sync_tied_gradients(stage: PipelineStage, group, *, timeout: float | None = None) -> None:
    """Add the first and last stages' gradients of a tied embedding/head (no-op otherwise).

    `group` holds both the first and the last stage's rank (`pipeline_links(...).ends`).
    Both stages end with `embedding_grad + head_grad` (float addition commutes, so the two
    copies stay bitwise equal). A weight with float32 gradient accumulation (`main_grad`,
    `flashcp.optim.zero.attach_main_grad`: low-precision storage) adds those instead.
    """
    weight = stage.tied_weight
    if weight is None:
        return
    peer = group.ranks[-1] if stage.is_first else group.ranks[0]
    hooked = hasattr(weight, "main_grad")
    current = weight.main_grad if hooked else weight.grad
    with paddle.no_grad():
        if current is not None:
            mine = current
        else:
            mine = paddle.zeros(weight.shape, "float32" if hooked else weight.dtype)
        other = swap_tensor(mine, peer, group, send_first=stage.is_first, timeout=timeout)
        total = mine + other
    if hooked:
        weight.main_grad = total
    elif weight.grad is None:
        weight.grad = total  # type: ignore[misc]
    else:
        paddle.assign(total, weight.grad)


class PipelineSchedule:
    """Runs one training step's forward and backward passes of `stage` over the pp group.

    `groups` are this rank's `build_groups` result; its pp group rank must be `stage.stage`.
    Transfers go over `pipeline_links(groups)` (two-rank groups on gloo with pp > 2, else
    `groups.pp`). `kind` is "1f1b" (default) or "gpipe". Gradients accumulate into the
    stage's parameters' `.grad`; the optimizer step, the dp / cp gradient reduction and
    zeroing stay with the caller.
    """

    def __init__(
        self,
        stage: PipelineStage,
        groups: ParallelGroups,
        *,
        kind: ScheduleKind | str = "1f1b",
        timeout: float | None = None,
        forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        if kind not in SCHEDULE_FNS:
            raise ValueError(
                f"pipeline schedule {kind!r} is unknown: use one of {', '.join(SCHEDULES)}"
            )
        pp = groups.pp
        if int(pp.nranks) != stage.num_stages:
            raise ValueError(
                f"the pipeline stage is one of {stage.num_stages} stages but the pp group "
                f"{group_label(pp)} has {pp.nranks} ranks: build the stage with "
                "num_stages=groups.pp.nranks (parallel.pp)"
            )
        if int(pp.rank) != stage.stage:
            raise ValueError(
                f"this rank is pp index {pp.rank} of {group_label(pp)} but holds stage "
                f"{stage.stage}: build the stage with stage=groups.pp.rank"
            )
        self.stage = stage
        self.group = pp
        self.kind = kind
        self.timeout = timeout
        ranks = list(pp.ranks)
        self.prev = ranks[stage.stage - 1] if not stage.is_first else None
        self.next = ranks[stage.stage + 1] if not stage.is_last else None
        self.links = pipeline_links(groups, tied=stage.tied_weight is not None, timeout=timeout)
        self.forward_context = forward_context
        self._plans: dict[tuple[str, int], list[Op]] = {}

    def plan(self, num_micro: int, kind: str | None = None) -> list[Op]:
        """This stage's plan for `num_micro` micro-batches under `kind` (default: the
        schedule's), checked deadlock-free once."""
        key = (kind or self.kind, num_micro)
        if key not in self._plans:
            plans = build_plans(key[0], self.stage.num_stages, num_micro)
            simulate_plans(plans)
            self._plans[key] = plans[self.stage.stage]
        return self._plans[key]

    def run(
        self,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn = sum_cross_entropy,
        *,
        num_targets: int,
        broadcast_loss: bool = True,
    ) -> PipelineStepResult:
        """Forward and backward every micro-batch; returns the step's loss."""
        state = self.start(micro_batches, loss_fn, num_targets=num_targets)
        for op in state.plan:
            self.step(state, op)
        return self.finish(state, broadcast_loss=broadcast_loss)

    def start(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, num_targets: int
    ) -> StepState:
        """Validate a step's inputs and return its state (`run` = start, every step, finish)."""
        if isinstance(num_targets, bool) or not isinstance(num_targets, int | np.integer):
            raise ValueError(f"num_targets must be an int, got {num_targets!r}")
        if num_targets < 1:
            raise ValueError(
                f"num_targets must be the GLOBAL target-token count (>= 1), got {num_targets}"
            )
        if self.stage.is_last and any(
            mb.labels is None and mb.loss is None for mb in micro_batches
        ):
            raise ValueError(
                "the last pipeline stage needs labels (or a loss) in every micro-batch"
            )
        plan = self.plan(len(micro_batches))
        return StepState(list(micro_batches), loss_fn, int(num_targets), plan)

    def step(self, state: StepState, op: Op) -> None:
        """Execute one plan step (a pass or a transfer) of this stage."""
        stage, links, t = self.stage, self.links, self.timeout
        kind, m = op
        mb = state.micro_batches[m]
        shape = stage.activation_shape(mb.input_ids.shape)
        if kind == "recv_act":
            x = recv_tensor(shape, stage.activation_dtype, self.prev, links.prev, timeout=t)
            x.stop_gradient = False
            state.inputs[m] = x
        elif kind == "F":
            x = mb.input_ids if stage.is_first else state.inputs[m]
            with self.forward_context():
                out = stage(x, mb.positions, mb.attn)
                if stage.is_last:
                    head = HeadInput(out, stage)
                    if mb.loss is not None:
                        out = mb.loss(head)
                    else:
                        out = state.loss_fn(head, mb.labels) / float(state.num_targets)
            if stage.is_last:
                state.losses.append(out.detach())
            state.outputs[m] = out
        elif kind == "send_act":
            send_tensor(state.outputs[m], self.next, links.next, timeout=t)
        elif kind == "recv_grad":
            state.grads[m] = recv_tensor(
                shape, stage.activation_dtype, self.next, links.next, timeout=t
            )
        elif kind == "B":
            out = state.outputs.pop(m)
            if stage.is_last:
                out.backward()
            else:
                paddle.autograd.backward([out], [state.grads.pop(m)])
        elif kind == "send_grad":
            x = state.inputs.pop(m)
            g = x.grad if x.grad is not None else paddle.zeros_like(x)
            send_tensor(g, self.prev, links.prev, timeout=t)
        else:
            raise ValueError(f"unknown pipeline step {op}")

    def forward_only(
        self,
        micro_batches: Sequence[MicroBatch],
        out_fn: Callable[[paddle.Tensor, MicroBatch], Any],
        *,
        module: PipelineStage | None = None,
    ) -> list[Any] | None:
        """Run every micro-batch forward (no gradients) through `module` (default: this
        schedule's stage; e.g. a frozen reference copy split the same way).

        The last stage returns `[out_fn(HeadInput(hidden, module), micro_batch) for each
        micro-batch]` (final-norm hidden states with the module's LM head); the other stages
        return None. Activations travel over the same links as in training.
        """
        stage = module or self.stage
        if (stage.stage, stage.num_stages) != (self.stage.stage, self.stage.num_stages):
            raise ValueError(
                f"module is stage {stage.stage}/{stage.num_stages} but the schedule runs stage "
                f"{self.stage.stage}/{self.stage.num_stages}: split both models the same way"
            )
        links, t = self.links, self.timeout
        inputs: dict[int, paddle.Tensor] = {}
        outputs: dict[int, paddle.Tensor] = {}
        results: list[Any] = []
        with paddle.no_grad():
            for kind, m in self.plan(len(micro_batches), FORWARD):
                mb = micro_batches[m]
                if kind == "recv_act":
                    shape = stage.activation_shape(mb.input_ids.shape)
                    inputs[m] = recv_tensor(
                        shape, stage.activation_dtype, self.prev, links.prev, timeout=t
                    )
                elif kind == "F":
                    x = mb.input_ids if stage.is_first else inputs.pop(m)
                    with self.forward_context():
                        out = stage(x, mb.positions, mb.attn)
                        if stage.is_last:
                            results.append(out_fn(HeadInput(out, stage), mb))
                    if not stage.is_last:
                        outputs[m] = out
                elif kind == "send_act":
                    send_tensor(outputs.pop(m), self.next, links.next, timeout=t)
                else:
                    raise ValueError(f"unexpected step {kind} in a forward-only plan")
        return results if stage.is_last else None

    def finish(self, state: StepState, *, broadcast_loss: bool = True) -> PipelineStepResult:
        """Sync tied gradients, sum (and broadcast) the loss."""
        if state.outputs or state.grads or state.inputs:
            raise RuntimeError(
                f"pipeline step finished with micro-batches still in flight: outputs "
                f"{sorted(state.outputs)}, gradients {sorted(state.grads)}"
            )
        if self.links.ends is not None:
            sync_tied_gradients(self.stage, self.links.ends, timeout=self.timeout)
        total = paddle.zeros([], dtype="float32")
        for loss in state.losses:
            total = total + loss
        if broadcast_loss and self.stage.num_stages > 1:
            broadcast_tensor(total, self.group.ranks[-1], self.group, timeout=self.timeout)
        return PipelineStepResult(total, [float(x) for x in state.losses])


def train_step_1f1b(
    stage: PipelineStage,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    groups: ParallelGroups,
    *,
    num_targets: int,
    kind: ScheduleKind | str = "1f1b",
    timeout: float | None = None,
) -> PipelineStepResult:
    """One step of `stage` under the 1F1B schedule on `groups.pp` (see `PipelineSchedule`)."""
    schedule = PipelineSchedule(stage, groups, kind=kind, timeout=timeout)
    return schedule.run(micro_batches, loss_fn, num_targets=num_targets)
