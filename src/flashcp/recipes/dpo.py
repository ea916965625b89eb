"""The DPO recipe: preference pairs packed with the share-question FlashMask, DPO losses,
reference log-probs from a frozen copy (or the same model with its LoRA adapters off), under
any dp × pp × cp layout.

One step:

1. `DPOData` gives this dp rank's micro-batches of packed rows (`DPOBatch`: several examples
   per row, positions restarting for each answer, `spans` locating every answer's labels).
2. `plan` shards each row to this cp rank and counts the step's examples over dp: every
   micro-batch's loss is `sum of its per-example DPO losses / N`, N the GLOBAL number of
   examples of the step, so any layout averages over the same set as one process.
3. `prepare` runs the reference model forward only (no gradients) on every micro-batch: the
   frozen copy, or the policy inside `disable_adapters` with LoRA; under pp > 1 it is a
   forward-only pass through the pipeline and the results stay on the last stage, where the
   losses are computed.
4. The runner runs the policy forward and backward; each micro-batch's loss closure turns the
   last stage's final-norm hidden states (`HeadInput`) into per-token log-probs over chunks of
   `train.loss_chunk_tokens` answer tokens (no full logits; each chunk's logits recomputed in
   backward), sums them over each answer's span and applies the DPO loss
   (`flashcp.recipes.dpo_loss.dpo_terms`). The reference pass uses the same chunked head.

Context parallelism: a cp rank holds only some tokens of every answer, so its span sums are
partial. `replicated_sum` all-reduces them over the cp group; from there every cp rank computes
the same (replicated) loss. Its backward is the IDENTITY: the loss is a function of the global
sums S = Σ_r s_r, each rank back-propagates dL/dS (identical on every rank, since each computed
the same L from the same S) into its own partial s_r, and ∂S/∂s_r = 1. Summing the resulting
parameter gradients over cp (as the trainer does for every recipe) then gives exactly
dL/dθ = Σ_r dL/dS · ∂s_r/∂θ. An all-reduce in the backward as well would count every
contribution cp times. Statistics of replicated values (loss, rewards) are reported by cp rank 0
only, so the trainer's sums over all ranks count each example once.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer

from flashcp.attention.context import AttentionContext
from flashcp.config.recipes import DPOConfig
from flashcp.cp.layout import assigned_positions
from flashcp.cp.shard import shard_batch
from flashcp.data.dpo import IGNORE_INDEX, DPOBatch
from flashcp.data.dpo_stream import DPOData
from flashcp.distributed import all_reduce_tensor
from flashcp.models import HeadInput
from flashcp.optim.grads import all_reduce_values
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.recipes.base import Recipe, StepPlan
from flashcp.recipes.dpo_loss import dpo_terms, sequence_logps

STATS = ("chosen", "rejected", "wins", "examples", "logps_chosen", "logps_rejected")
"""Per-step sums the recipe reports (this rank's share): rewards, wins, examples, and the
policy's answer log-prob sums."""
EVAL_STATS = (
    "loss", "chosen", "rejected", "wins", "examples", "logps_chosen", "logps_rejected", "targets"
)  # fmt: skip
"""Per-eval-batch sums (this rank's share): DPO losses, rewards, wins, examples, the policy's
answer log-prob sums, and the answer tokens (labels) of this rank's shard."""


class _ReplicatedSum(PyLayer):
    """Forward: sum over the group. Backward: identity (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, group: Any) -> paddle.Tensor:  # type: ignore[override]
        return all_reduce_tensor(x, group)

    @staticmethod
    def backward(ctx: Any, grad: paddle.Tensor) -> paddle.Tensor:  # type: ignore[override]
        return grad


def replicated_sum(x: paddle.Tensor, group: Any) -> paddle.Tensor:
    """The sum of `x` over `group`, differentiable for a loss computed identically on every
    member (gradient passed through unchanged); `x` itself for a one-rank group."""
    if group is None or int(group.nranks) == 1:
        return x
    return _ReplicatedSum.apply(x, group)


@dataclass
class _Micro:
    """What a micro-batch's loss needs besides the hidden states (this rank's view)."""

    index: int
    labels: paddle.Tensor
    spans: np.ndarray
    columns: np.ndarray
    lengths: np.ndarray
    """Answer token counts `[N, 2]` (for IPO's length-averaged log-probs)."""


class DPORecipe(Recipe):
    """DPO on `prompt` / `chosen` / `rejected` records (`data.path`, or the built-in set)."""

    name = "dpo"

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.dpo: DPOConfig = self.cfg.extras.get("dpo") or DPOConfig()
        self.reference: paddle.nn.Layer | None = None
        """The frozen reference copy of this rank's stage (None with LoRA: adapters off)."""
        self._micro: dict[int, _Micro] = {}
        self._ref: list[tuple[paddle.Tensor, paddle.Tensor]] = []
        self._sums = np.zeros(len(STATS))
        self._examples = 0

    # -- setup ------------------------------------------------------------------------------

    def build_data(self) -> DPOData:
        ctx = self.ctx
        return DPOData(self.cfg, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, peers=ctx.data_peers())

    def setup_model(self, model: paddle.nn.Layer) -> None:
        """LoRA: adapters on the policy (the reference is the same model, adapters off).
        Otherwise the reference is a frozen copy of this rank's initial stage, in the same
        storage dtype (`train.param_dtype`): no rank holds more than its stage twice."""
        if self.apply_lora(model):
            return
        reference = copy.deepcopy(model)
        for p in reference.parameters():
            p.stop_gradient = True
        reference.eval()
        self.reference = reference

    # -- one step ---------------------------------------------------------------------------

    def plan(self, batches: list[DPOBatch]) -> StepPlan:
        ctx, cfg = self.ctx, self.cfg
        local = [int(b.num_examples) for b in batches]
        labels_total = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
        counts = all_reduce_values([sum(local), labels_total], [ctx.groups.dp])
        self._examples = int(round(counts[0]))
        denom = float(max(self._examples, 1))
        self._micro = {}
        self._sums = np.zeros(len(STATS))
        micro = []
        for index, batch in enumerate(batches):
            asg = ctx.assignment_for(batch)
            local = shard_batch(batch, ctx.cp_rank, asg)
            labels = paddle.to_tensor(local.labels)
            attn = AttentionContext(
                mask=batch.mask.indices,
                causal=batch.mask.causal,
                group=ctx.groups.cp,
                assignment=asg,
                mode=cfg.parallel.cp_mode,
                fa4_unavailable=cfg.attention.fa4_unavailable,
            )
            mb = MicroBatch(
                paddle.to_tensor(local.input_ids),
                paddle.to_tensor(local.positions),
                labels,
                attn,
            )
            mb.loss = partial(self._loss, mb=mb, denom=denom)
            spans = np.asarray(batch.spans)
            self._micro[id(mb)] = _Micro(
                index=index,
                labels=labels,
                spans=spans,
                columns=assigned_positions(batch.shape[1], ctx.cp_rank, asg),
                lengths=np.maximum(spans[..., 2] - spans[..., 1], 1).astype(np.float32),
            )
            micro.append(mb)
        seq_len = batches[0].shape[1] if batches else 0
        tokens = ctx.dp_size * cfg.train.grad_accum * cfg.data.micro_batch_size * seq_len
        return StepPlan(micro=micro, tokens=tokens, targets=int(round(counts[1])))

    def answer_logps(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(chosen, rejected) log-prob sums `[N]` of the micro-batch's examples, summed over
        the cp group (length-averaged for IPO), from the last stage's output `out`."""
        m = self._micro[id(mb)]
        token_lp = out.token_logprobs(m.labels, chunk_tokens=self.cfg.train.loss_chunk_tokens)
        chosen, rejected = sequence_logps(token_lp, m.spans, columns=m.columns)
        group = self.ctx.groups.cp
        if paddle.is_grad_enabled():
            chosen, rejected = replicated_sum(chosen, group), replicated_sum(rejected, group)
        elif int(group.nranks) > 1:
            chosen, rejected = all_reduce_tensor(chosen, group), all_reduce_tensor(rejected, group)
        if self.dpo.loss_type == "ipo":
            lengths = paddle.to_tensor(m.lengths)
            chosen, rejected = chosen / lengths[:, 0], rejected / lengths[:, 1]
        return chosen, rejected

    def prepare(self, plan: StepPlan, runner: PipelineRunner, module: paddle.nn.Layer) -> None:
        """Reference log-probs of every micro-batch (last pipeline stage only)."""
        if self.lora is not None:
            from flashcp.lora.model import disable_adapters, lora_layers

            off = disable_adapters(module) if lora_layers(module) else contextlib.nullcontext()
            with off:
                results = runner.forward_only(plan.micro, self.answer_logps)
        else:
            results = runner.forward_only(plan.micro, self.answer_logps, self.reference)
        self._ref = list(results or [])

    def _terms(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, ...]:
        """Policy log-probs (chosen, rejected), then `dpo_terms` against the stored reference:
        per-example loss and the chosen / rejected rewards."""
        chosen, rejected = self.answer_logps(out, mb)
        ref_chosen, ref_rejected = self._ref[self._micro[id(mb)].index]
        per, chosen_r, rejected_r = dpo_terms(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=self.dpo.beta,
            loss_type=self.dpo.loss_type,
            label_smoothing=self.dpo.label_smoothing,
        )
        return chosen, rejected, per, chosen_r, rejected_r

    def _loss(self, out: HeadInput, *, mb: MicroBatch, denom: float) -> paddle.Tensor:
        chosen, rejected, per, chosen_r, rejected_r = self._terms(out, mb)
        loss = per.sum() / denom
        if self.ctx.cp_rank == 0:  # replicated over cp: count each example once
            wins = (chosen_r > rejected_r).astype("float32")
            self._sums += [
                float(chosen_r.sum()),
                float(rejected_r.sum()),
                float(wins.sum()),
                float(per.shape[0]),
                float(chosen.sum()),
                float(rejected.sum()),
            ]
        return loss

    # -- evaluation -------------------------------------------------------------------------

    def eval_sums(
        self, batches: list[DPOBatch], runner: PipelineRunner, module: paddle.nn.Layer
    ) -> list[float]:
        """EVAL_STATS of this rank for one eval batch: the reference and then the policy run
        forward only, the DPO terms on the last stage (cp rank 0 reports: they are
        replicated over cp). The training step's recipe state is restored afterwards."""
        saved = (self._micro, self._ref, self._sums, self._examples)
        try:
            plan = self.plan(batches)
            self.prepare(plan, runner, module)
            results = runner.forward_only(plan.micro, self._eval_terms) or []
        finally:
            self._micro, self._ref, self._sums, self._examples = saved
        total = np.zeros(len(EVAL_STATS))
        for r in results:
            total += r
        return [float(x) for x in total]

    def _eval_terms(self, out: HeadInput, mb: MicroBatch) -> np.ndarray:
        chosen, rejected, per, chosen_r, rejected_r = self._terms(out, mb)
        out = np.zeros(len(EVAL_STATS))
        out[-1] = float((self._micro[id(mb)].labels != IGNORE_INDEX).astype("int64").sum())
        if self.ctx.cp_rank != 0:  # the rest is replicated over cp: cp rank 0 reports it
            return out
        wins = (chosen_r > rejected_r).astype("float32")
        out[:-1] = [
            float(per.sum()),
            float(chosen_r.sum()),
            float(rejected_r.sum()),
            float(wins.sum()),
            float(per.shape[0]),
            float(chosen.sum()),
            float(rejected.sum()),
        ]
        return out

    def eval_metrics(self, sums: np.ndarray) -> dict[str, float]:
        """Mean DPO loss, rewards, margin and accuracy over the eval set's pairs, the policy's
        mean answer log-prob sums, the pair and answer-token counts."""
        s = dict(zip(EVAL_STATS, (float(x) for x in sums), strict=True))
        n = max(s["examples"], 1.0)
        return {
            "loss": s["loss"] / n,
            "rewards/chosen": s["chosen"] / n,
            "rewards/rejected": s["rejected"] / n,
            "rewards/margin": (s["chosen"] - s["rejected"]) / n,
            "rewards/accuracy": s["wins"] / n,
            "logps/chosen": s["logps_chosen"] / n,
            "logps/rejected": s["logps_rejected"] / n,
            "examples": s["examples"],
            "targets": s["targets"],
        }

    # -- reporting --------------------------------------------------------------------------

    def loss_value(self, micro_losses: Any) -> float:
        return super().loss_value(micro_losses) if self.ctx.cp_rank == 0 else 0.0

    def step_stats(self) -> list[float]:
        return [float(x) for x in self._sums]

    def metrics(self, stats: np.ndarray) -> dict[str, float]:
        """Rewards (β·(log π − log π_ref)) averaged over the step's examples, their margin,
        the fraction of pairs where the chosen answer wins, and the policy's mean answer
        log-prob sums (`logps/*`: the magnitude the rewards are small differences of)."""
        sums = dict(zip(STATS, (float(x) for x in stats), strict=True))
        n = max(sums["examples"], 1.0)
        return {
            "rewards/chosen": sums["chosen"] / n,
            "rewards/rejected": sums["rejected"] / n,
            "rewards/margin": (sums["chosen"] - sums["rejected"]) / n,
            "rewards/accuracy": sums["wins"] / n,
            "examples": sums["examples"],
            "logps/chosen": sums["logps_chosen"] / n,
            "logps/rejected": sums["logps_rejected"] / n,
        }
