"""The DPO recipe: preference pairs packed with the share-question FlashMask, DPO losses,
reference log-probs from a frozen copy (or the same model with its LoRA adapters off), under
any dp × pp × cp layout.

One step:

1. `DPOData` gives this dp rank's micro-batches of packed rows (`DPOBatch`: several examples
   per row, positions restarting for each answer, `spans` locating every answer's labels).
2. `count` counts the step's examples (the trainer sums them over dp and cuts each row to this
   cp rank): every micro-batch's loss is `sum of its per-example DPO losses / N`, N the GLOBAL
   number of examples of the step, so any layout averages over the same set as one process.
3. `prepare` runs the reference model forward only (no gradients) on every micro-batch: the
   frozen copy, or the policy inside `disable_adapters` with LoRA; under pp > 1 it is a
   forward-only pass through the pipeline and the results stay on the last stage, where the
   losses are computed, in each micro-batch's `payload["reference"]`.
4. The runner runs the policy forward and backward; `loss` turns the last stage's final-norm
   hidden states (`HeadInput`) into per-token log-probs over chunks of
   `train.loss_chunk_tokens` answer tokens (no full logits; each chunk's logits recomputed in
   backward), sums them over each answer's span (`MicroBatch.batch.spans`) and applies the DPO
   loss (`flashcp.recipes.dpo_loss.dpo_terms`). The reference pass uses the same chunked head.
   Its statistics (`STATS`: losses, rewards, wins, examples, the policy's answer log-prob sums,
   answer tokens) serve training and evaluation alike (`finish`).

Context parallelism: a cp rank holds only some tokens of every answer, so its span sums are
partial. `replicated_sum` all-reduces them over the cp group; from there every cp rank computes
the same (replicated) loss. Its backward is the IDENTITY: the loss is a function of the global
sums S = Σ_r s_r, each rank back-propagates dL/dS (identical on every rank, since each computed
the same L from the same S) into its own partial s_r, and ∂S/∂s_r = 1. Summing the resulting
parameter gradients over cp (as the trainer does for every recipe) then gives exactly
dL/dθ = Σ_r dL/dS · ∂s_r/∂θ. An all-reduce in the backward as well would count every
contribution cp times. The loss and statistics are replicated over cp (`replicated`): only cp
rank 0's enter the job's sums, so every example counts once.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer

from flashcp.config.recipes import DPOConfig
from flashcp.cp.layout import assigned_positions
from flashcp.data.dpo_packing import IGNORE_INDEX, DPOBatch
from flashcp.data.dpo_stream import DPOData
from flashcp.distributed import all_reduce_tensor
from flashcp.lora.model import disable_adapters, lora_layers
from flashcp.models import HeadInput
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.recipes.base import Recipe
from flashcp.recipes.dpo_loss import dpo_terms, sequence_logps

STATS = (
    "loss", "chosen", "rejected", "wins", "examples", "logps_chosen", "logps_rejected", "targets"
)  # fmt: skip
"""A micro-batch's sums: DPO losses, rewards, wins, examples, the policy's answer log-prob
sums, and the answer tokens (labels) of its full rows."""


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


class DPORecipe(Recipe):
    """DPO on `prompt` / `chosen` / `rejected` records (`data.path`, or the built-in set)."""

    name = "dpo"
    data_class = DPOData
    stats = STATS
    step_metrics = (
        "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "examples",
        "logps/chosen", "logps/rejected",
    )  # fmt: skip
    replicated = True

    def __init__(self, cfg: Any, groups: Any) -> None:
        super().__init__(cfg, groups)
        self.dpo: DPOConfig = self.cfg.extras.get("dpo") or DPOConfig()
        self.reference: paddle.nn.Layer | None = None
        """The frozen reference copy of this rank's stage (None with LoRA: adapters off)."""

    def setup(self, model: paddle.nn.Layer) -> None:
        """Without LoRA the reference is a frozen copy of this rank's initial stage, in the
        same storage dtype (`train.param_dtype`): no rank holds more than its stage twice.
        With LoRA it is the policy itself with its adapters switched off."""
        if self.cfg.extras.get("lora") is not None:
            return
        reference = copy.deepcopy(model)
        for p in reference.parameters():
            p.stop_gradient = True
        reference.eval()
        self.reference = reference

    def count(self, batches: Sequence[DPOBatch]) -> tuple[float, float]:
        """(examples, answer tokens) of this dp rank's rows."""
        examples = sum(int(b.num_examples) for b in batches)
        return float(examples), float(sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches))

    def answer_logps(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(chosen, rejected) log-prob sums `[N]` of the micro-batch's examples, summed over
        the cp group (length-averaged for IPO), from the last stage's output `out`."""
        batch, group = mb.batch, self.groups.cp
        spans = np.asarray(batch.spans)
        columns = assigned_positions(batch.shape[1], int(group.rank), mb.attn.assignment)
        token_lp = out.token_logprobs(mb.labels, chunk_tokens=self.cfg.train.loss_chunk_tokens)
        chosen, rejected = sequence_logps(token_lp, spans, columns=columns)
        if paddle.is_grad_enabled():
            chosen, rejected = replicated_sum(chosen, group), replicated_sum(rejected, group)
        elif int(group.nranks) > 1:
            chosen, rejected = all_reduce_tensor(chosen, group), all_reduce_tensor(rejected, group)
        if self.dpo.loss_type == "ipo":
            lengths = np.maximum(spans[..., 2] - spans[..., 1], 1).astype(np.float32)
            lengths = paddle.to_tensor(lengths)
            chosen, rejected = chosen / lengths[:, 0], rejected / lengths[:, 1]
        return chosen, rejected

    def prepare(self, micro: Sequence[MicroBatch], runner: PipelineRunner) -> None:
        """Reference log-probs of every micro-batch, in its `payload` (last stage only)."""
        if self.reference is None:
            module = runner.stage
            off = disable_adapters(module) if lora_layers(module) else contextlib.nullcontext()
            with off:
                results = runner.forward_only(micro, self.answer_logps)
        else:
            results = runner.forward_only(micro, self.answer_logps, self.reference)
        for mb, reference in zip(micro, results or [], strict=False):
            mb.payload["reference"] = reference

    def loss(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, list[Any]]:
        """Summed DPO loss of the micro-batch's examples against the reference log-probs
        `prepare` attached; its `STATS`."""
        chosen, rejected = self.answer_logps(out, mb)
        ref_chosen, ref_rejected = mb.payload["reference"]
        per, chosen_r, rejected_r = dpo_terms(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=self.dpo.beta,
            loss_type=self.dpo.loss_type,
            label_smoothing=self.dpo.label_smoothing,
        )
        total = per.sum()
        wins = (chosen_r > rejected_r).astype("float32")
        targets = int((mb.batch.labels != IGNORE_INDEX).sum())
        stats = [
            float(total), float(chosen_r.sum()), float(rejected_r.sum()), float(wins.sum()),
            float(per.shape[0]), float(chosen.sum()), float(rejected.sum()), float(targets),
        ]  # fmt: skip
        return total, stats

    def finish(self, sums: Sequence[float]) -> dict[str, float]:
        """Mean DPO loss, rewards (β·(log π − log π_ref)), their margin and the fraction of
        pairs where the chosen answer wins, the policy's mean answer log-prob sums (`logps/*`:
        the magnitude the rewards are small differences of), the pair and answer-token
        counts."""
        s = dict(zip(STATS, (float(x) for x in sums), strict=True))
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
