"""The ONE runner of a step's micro-batches: forward, the recipe's loss, backward.

`PipelineRunner` runs a step's micro-batches on this rank's module under a pipeline schedule
(`flashcp.pipeline.schedule`: 1F1B or GPipe). One process's whole model is a one-stage
pipeline (a `CausalLM` built without a `StageSpec`), and with one stage the plan is simply
"forward, loss, backward" per micro-batch in order, with no transfers — so pp = 1 and pp > 1
are the same code, and the planner (`flashcp.plan`, one micro-batch in flight at pp = 1) and the
golden losses see the same operations, in the same order, as before.

Design decision: flashcp runs its OWN 1F1B schedule on point-to-point send / recv
(`flashcp.distributed.p2p`) rather than Paddle fleet's `PipelineLayer` / `train_batch`. Ours
composes with flashcp's CP groups (gloo groups on dedicated stores, `build_groups`) and its
watchdog timeouts and byte counters; fleet's `PipelineParallel` wants its own hybrid
communicate group, and on CPU it only ran after patching `ParallelEnv._device_id = 0` and
setting `pp_configs.use_batch_p2p_comm = False`. Our schedule's gradients are bitwise equal
to one process's on CPU (tested), and every transfer is visible to flashcp's counters.

Activations `[B, L_local, H]` and their gradients travel between ranks with the same cp (and
dp) index on adjacent stages, i.e. within `groups.pp`, over `pipeline_links` (two-rank gloo
groups when pp > 2, because of gloo's per-group tags; see `flashcp.distributed.p2p`). The
shape follows from the micro-batch's token shape and the hidden size, so only payload travels.
CP stays inside each stage: the micro-batch's `AttentionContext` carries the cp group.

The loss contract: the last stage (the whole `CausalLM` at pp = 1) returns final-norm hidden
states `[B, L_local, H]`; the runner hands them with the stage as the LM head to the step's
loss function (`train(micro, loss_fn)`: `loss_fn(HeadInput, mb) -> (loss, stats)`, the
trainer's wrapper of the recipe's `loss`) as a `flashcp.models.HeadInput`, which computes
log p(label) with `out.token_logprobs(labels, chunk_tokens=...)` (chunked: no
`[tokens, vocab]` float32 logits). The loss is already divided by the GLOBAL count of the step
(all micro-batches, all cp / dp ranks), so the micro-batch losses sum to the single-process
mean loss and the gradients match; `stats` are a few numbers (floats or 0-D tensors) the runner
reads after the micro-batch's backward and sums over the step's micro-batches. The loss
function runs under the forward context (autocast), like the head it calls. Backward runs the
micro-batches in ascending order on every stage, as a single process accumulating them one by
one does: on CPU the PP = 2 gradients are bitwise equal to PP = 1
(`tests/integration/test_pipeline_multiproc.py`); the tied embedding/head gradient of the
first and last stage is summed at the end of the step.

`forward_only(micro, out_fn, module)`: a pass without gradients (e.g. DPO reference log-probs
through a frozen copy, or with LoRA adapters switched off) whose `out_fn(HeadInput(hidden,
module), mb)` results come back in micro-batch order on the last stage (None on the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from flashcp.attention.context import AttentionContext
from flashcp.attention.registry import DEFAULT_MODE, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.cp.shard import shard_batch
from flashcp.distributed.collectives import group_label
from flashcp.distributed.groups import ParallelGroups
from flashcp.distributed.p2p import (
    PipelineLinks,
    pipeline_links,
    recv_tensor,
    send_tensor,
    swap_tensor,
)
from flashcp.fa_dispatch import Policy
from flashcp.log import process_rank
from flashcp.models.head import HeadInput, backward_follows
from flashcp.models.mtp import mtp_targets
from flashcp.models.offload import release_sent
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

LossFn = Callable[["HeadInput", "MicroBatch"], tuple[paddle.Tensor, Sequence[Any]]]
"""A micro-batch's loss (normalised, to back-propagate) and its statistics."""


@dataclass
class MicroBatch:
    """One micro-batch as THIS rank sees it (its cp shard when CP is on).

    `input_ids` / `positions` (GLOBAL positions) are `[B, L_local]`; `labels` `[B, L_local]`
    (already shifted on the full sequence, `-100` = no target) are what the recipes' losses
    read. `batch` is the FULL batch it was cut from (`MicroBatch.of`): the recipe's data of
    this micro-batch (e.g. DPO answer spans); `payload` holds what the recipe's `prepare`
    attached to it (e.g. DPO reference log-probs).
    """

    input_ids: paddle.Tensor
    positions: paddle.Tensor
    labels: paddle.Tensor | None
    attn: AttentionContext
    batch: Any = None
    payload: dict[str, Any] = field(default_factory=dict)
    mtp_ids: paddle.Tensor | None = None
    """`[D, B, L_local]`: the tokens each MTP depth takes (`flashcp.models.mtp.mtp_targets`,
    built on the full sequence and cut like the labels); None unless MTP is trained."""
    mtp_labels: paddle.Tensor | None = None
    """`[D, B, L_local]`: each MTP depth's targets (`-100` = none)."""

    @classmethod
    def of(
        cls,
        batch: Any,
        group: Any = None,
        *,
        mode: str = DEFAULT_MODE,
        fa4_unavailable: str | Policy | None = None,
        query_chunk: int = 0,
        kv_chunk: int = 0,
        mtp_depth: int = 0,
    ) -> MicroBatch:
        """This rank's micro-batch of the FULL `batch` (`[B, S]` tokens, labels, positions
        and its global mask): its share of every sequence under the layout cp mode `mode` makes
        over the cp `group` (fixed, or from the batch's mask; `flashcp.cp.shard`; None: one
        rank, the whole sequence). The mask stays global, in the attention context with the
        group and layout (and `attention.query_chunk` / `kv_chunk`: chunked attention).

        `mtp_depth` > 0 (trained MTP layers) adds each depth's inputs and targets, built on
        the full sequences (`flashcp.models.mtp.mtp_targets`, from the batch's `doc_lens`)
        and cut the same way."""
        mask = batch.mask
        size, rank = (1, 0) if group is None else (int(group.nranks), int(group.rank))
        assignment = make_assignment(mode, size, mask.indices, causal=mask.causal)
        local = shard_batch(batch, rank, assignment)
        mtp_ids = mtp_labels = None
        if mtp_depth:
            ids, targets = mtp_targets(batch.input_ids, batch.labels, batch.doc_lens, mtp_depth)
            mtp_ids = paddle.to_tensor(shard_assigned(ids, rank, assignment, axis=2))
            mtp_labels = paddle.to_tensor(shard_assigned(targets, rank, assignment, axis=2))
        attn = AttentionContext(
            mask=mask.indices,
            causal=mask.causal,
            group=group,
            assignment=assignment,
            mode=mode,
            fa4_unavailable=fa4_unavailable,
            query_chunk=query_chunk,
            kv_chunk=kv_chunk,
        )
        labels = paddle.to_tensor(local.labels)
        ids, positions = paddle.to_tensor(local.input_ids), paddle.to_tensor(local.positions)
        return cls(
            ids, positions, labels, attn, batch=batch, mtp_ids=mtp_ids, mtp_labels=mtp_labels
        )


@dataclass
class StepState:
    """The in-flight tensors of one step on one stage, keyed by micro-batch index."""

    micro_batches: list[MicroBatch]
    plan: list[Op]
    loss_fn: LossFn | None
    inputs: dict[int, paddle.Tensor] = field(default_factory=dict)
    outputs: dict[int, paddle.Tensor] = field(default_factory=dict)
    grads: dict[int, paddle.Tensor] = field(default_factory=dict)
    stats: dict[int, Sequence[Any]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    sums: np.ndarray | None = None
    """The micro-batches' statistics summed, in micro-batch order (last stage)."""
    backward_follows: frozenset[int] = frozenset()
    """Micro-batches whose backward is this stage's next pass after their forward (one stage,
    and 1F1B's last stage): their head may keep its one loss chunk (`models.head`)."""


def _next_pass_is_own_backward(plan: Sequence[Op]) -> frozenset[int]:
    """The micro-batches m whose ("F", m) is followed, among the passes, by ("B", m)."""
    passes = [op for op in plan if op[0] in ("F", "B")]
    return frozenset(
        m
        for (kind, m), nxt in zip(passes, passes[1:], strict=False)
        if kind == "F" and nxt == ("B", m)
    )


def _has_mtp(stage: Any) -> bool:
    """Whether the stage computes MTP heads besides its LM head (several head calls)."""
    layers = getattr(stage, "mtp_layers", None)
    return bool(layers()) if callable(layers) else False


def sync_tied_gradients(stage: PipelineStage, group, *, timeout: float | None = None) -> None:
    """Add the first and last stages' gradients of a tied embedding/head (no-op otherwise).

    `group` holds both the first and the last stage's rank (`pipeline_links(...).ends`).
    Both stages end with `embedding_grad + head_grad` (float addition commutes, so the two
    copies stay bitwise equal). A weight with float32 gradient accumulation (`main_grad`,
    `flashcp.optim.trainable.attach_main_grad`: low-precision storage) adds those instead.
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


class DetachedLossError(RuntimeError):
    """A micro-batch's loss does not depend on the model: its backward would be skipped."""


def check_attached(loss: paddle.Tensor, index: int) -> None:
    """Refuse to back-propagate a loss cut off from the graph. Paddle's `backward()` on such a
    tensor silently does nothing, so this rank would skip every collective of the backward
    (the all-gather-KV reduce-scatter, the MoE exchange) that its cp / ep peers wait in: a
    hang. A rank with nothing to contribute (no targets, no answer tokens) must return zeros
    computed from the hidden states instead (`models.head.chunked_token_logprobs`,
    `recipes.dpo_loss.sequence_logps` do)."""
    if loss.stop_gradient:
        raise DetachedLossError(
            f"the loss of micro-batch {index} on rank {process_rank()} does not depend on the "
            "model (stop_gradient): its backward would skip the collectives its peers run. A "
            "recipe's loss must stay attached to the hidden states even when this rank holds "
            "no targets (multiply by zero, not a constant)"
        )


def _check_head(module: Any) -> None:
    """The runner's module must be a `CausalLM` (a stage, or the whole model): it carries the
    LM head the loss functions call."""
    if not callable(getattr(module, "token_logprobs", None)):
        raise TypeError(
            f"the runner's module must carry the LM head (a CausalLM: `model(...)` returns "
            f"final-norm hidden states, `model.token_logprobs(hidden, labels)` the log-probs); "
            f"{type(module).__name__} has no token_logprobs"
        )


class PipelineRunner:
    """Runs a step's micro-batches on this rank's stage under the pipeline schedule `kind`.

    `stage`: this rank's `PipelineStage` (the whole model when pp = 1). `groups`: this rank's
    `build_groups` result; its pp group rank must be `stage.stage`. None: one stage in one
    process (nothing travels). Transfers go over `pipeline_links(groups)` (two-rank groups on
    gloo with pp > 2, else `groups.pp`). `micro_batches` cuts full batches into this rank's
    micro-batches (cp shards under `cp_mode`, over `groups.cp`). `kind` is "1f1b" (default) or
    "gpipe"; with one stage every schedule runs the micro-batches one after the other (forward,
    loss, backward each: GPipe's forwards-first would only keep every micro-batch's activations
    alive). Gradients accumulate into the stage's parameters' `.grad`; the optimizer step, the
    dp / cp gradient reduction and zeroing stay with the caller.
    """

    def __init__(
        self,
        stage: PipelineStage,
        groups: ParallelGroups | None = None,
        *,
        kind: ScheduleKind | str = "1f1b",
        timeout: float | None = None,
        forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
        cp_mode: str = DEFAULT_MODE,
        fa4_unavailable: str | Policy | None = None,
        query_chunk: int = 0,
        kv_chunk: int = 0,
        mtp_depth: int = 0,
    ) -> None:
        _check_head(stage)
        if kind not in SCHEDULE_FNS:
            raise ValueError(
                f"pipeline schedule {kind!r} is unknown: use one of {', '.join(SCHEDULES)}"
            )
        self.stage = stage
        self.kind = kind if stage.num_stages > 1 else "1f1b"
        self.timeout = timeout
        self.forward_context = forward_context
        self.cp = groups.cp if groups is not None else None
        self.cp_mode, self.fa4_unavailable = cp_mode, fa4_unavailable
        self.chunks = {"query_chunk": query_chunk, "kv_chunk": kv_chunk}  # attention.*
        self.mtp_depth = mtp_depth
        """MTP depths whose inputs and targets each micro-batch carries (trained MTP only)."""
        self.prev: int | None = None
        self.next: int | None = None
        self.links = PipelineLinks(None, None, None)
        if groups is not None:
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
            ranks = list(pp.ranks)
            self.prev = ranks[stage.stage - 1] if not stage.is_first else None
            self.next = ranks[stage.stage + 1] if not stage.is_last else None
            self.links = pipeline_links(groups, tied=stage.tied_weight is not None, timeout=timeout)
        elif stage.num_stages != 1:
            raise ValueError(
                f"stage {stage.stage} of {stage.num_stages} needs the process groups "
                "(build_groups) to reach the other stages"
            )
        self._plans: dict[tuple[str, int], list[Op]] = {}

    def micro_batches(self, batches: Sequence[Any]) -> list[MicroBatch]:
        """This rank's micro-batch of each FULL batch: its cp shard under `cp_mode`, with the
        MTP inputs and targets when `mtp_depth` > 0 (`MicroBatch.of`)."""
        return [
            MicroBatch.of(
                b,
                self.cp,
                mode=self.cp_mode,
                fa4_unavailable=self.fa4_unavailable,
                mtp_depth=self.mtp_depth,
                **self.chunks,
            )
            for b in batches
        ]

    def plan(self, num_micro: int, kind: str | None = None) -> list[Op]:
        """This stage's plan for `num_micro` micro-batches under `kind` (default: the
        runner's), checked deadlock-free once."""
        key = (kind or self.kind, num_micro)
        if key not in self._plans:
            plans = build_plans(key[0], self.stage.num_stages, num_micro)
            simulate_plans(plans)
            self._plans[key] = plans[self.stage.stage]
        return self._plans[key]

    def train(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn | None = None
    ) -> tuple[list[float], np.ndarray | None]:
        """Forward, `loss_fn` (the last stage's; other stages need none) and backward of every
        micro-batch; returns their losses and their statistics summed on the last stage ([]
        and None on the others)."""
        state = self.start(micro_batches, loss_fn)
        for op in state.plan:
            self.step(state, op)
        return self.finish(state)

    def start(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn | None = None
    ) -> StepState:
        """Validate a step's inputs and return its state (`train` = start, every step,
        finish)."""
        if self.stage.is_last and loss_fn is None:
            raise ValueError(
                "the last pipeline stage needs the step's loss function: train(micro, loss_fn)"
            )
        plan = self.plan(len(micro_batches))
        return StepState(
            list(micro_batches), plan, loss_fn, backward_follows=_next_pass_is_own_backward(plan)
        )

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
                    keep = m in state.backward_follows and not _has_mtp(stage)
                    with backward_follows(keep):
                        out, state.stats[m] = state.loss_fn(HeadInput(out, stage), mb)  # type: ignore[misc]
            # the last stage keeps only the loss: no reference to the hidden states outlives
            # the forward pass (the memory planner's count)
            state.outputs[m] = out
        elif kind == "send_act":
            send_tensor(state.outputs[m], self.next, links.next, timeout=t)
            release_sent(stage, state.outputs[m])  # offload: backward needs its node only
        elif kind == "recv_grad":
            state.grads[m] = recv_tensor(
                shape, stage.activation_dtype, self.next, links.next, timeout=t
            )
        elif kind == "B":
            out = state.outputs.pop(m)
            if stage.is_last:
                check_attached(out, m)
                out.backward()
                # read after backward and dropped: no loss tensor outlives its micro-batch
                state.losses.append(float(out))
                stats = np.asarray([float(x) for x in state.stats.pop(m)], dtype=np.float64)
                state.sums = stats if state.sums is None else state.sums + stats
            else:
                paddle.autograd.backward([out], [state.grads.pop(m)])
        elif kind == "send_grad":
            x = state.inputs.pop(m)
            # (shape and dtype: under offload the input's buffer went to the host)
            g = x.grad if x.grad is not None else paddle.zeros(x.shape, x.dtype)
            send_tensor(g, self.prev, links.prev, timeout=t)
        else:
            raise ValueError(f"unknown pipeline step {op}")

    def finish(self, state: StepState) -> tuple[list[float], np.ndarray | None]:
        """Sync tied gradients; the micro-batch losses and summed statistics (last stage; []
        and None elsewhere)."""
        if state.outputs or state.grads or state.inputs:
            raise RuntimeError(
                f"pipeline step finished with micro-batches still in flight: outputs "
                f"{sorted(state.outputs)}, gradients {sorted(state.grads)}"
            )
        if self.links.ends is not None:
            sync_tied_gradients(self.stage, self.links.ends, timeout=self.timeout)
        return state.losses, state.sums

    def forward_only(
        self,
        micro_batches: Sequence[MicroBatch],
        out_fn: Callable[[HeadInput, MicroBatch], Any],
        module: PipelineStage | None = None,
    ) -> list[Any] | None:
        """Run every micro-batch forward (no gradients) through `module` (default: this
        runner's stage; e.g. a frozen reference copy split the same way).

        The last stage returns `[out_fn(HeadInput(hidden, module), micro_batch) for each
        micro-batch]` (final-norm hidden states with the module's LM head); the other stages
        return None. Activations travel over the same links as in training. No micro-batches
        (a dp rank without rows in a short last eval batch: all its stages have none) is no pass.
        """
        stage = module if module is not None else self.stage
        _check_head(stage)
        if (stage.stage, stage.num_stages) != (self.stage.stage, self.stage.num_stages):
            raise ValueError(
                f"module is stage {stage.stage}/{stage.num_stages} but the runner runs stage "
                f"{self.stage.stage}/{self.stage.num_stages}: split both models the same way"
            )
        if not micro_batches:
            return [] if stage.is_last else None
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
