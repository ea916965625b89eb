"""Running a step's micro-batches: forward, the recipe's loss, backward.

The loss contract: the model (pp = 1: the whole `CausalLM`) or the last pipeline stage returns
final-norm hidden states `[B, L_local, H]`; the executor hands them with the module as the LM
head to the micro-batch's loss closure as a `flashcp.models.HeadInput`, and the closure computes
log p(label) with `out.token_logprobs(labels, chunk_tokens=train.loss_chunk_tokens)` (chunked:
no `[tokens, vocab]` float32 logits). The closure runs under the forward context (autocast),
like the head it calls.

`SequentialExecutor` (pp = 1): each micro-batch forward, `mb.loss(HeadInput(hidden, model))`,
backward, one after the other; the gradients accumulate in the parameters.

`PipelineExecutor` (pp > 1): the same passes under the pipeline schedule
(`flashcp.pipeline.PipelineSchedule`, 1F1B or GPipe) on this rank's stage; the loss closures run
on the last stage, activations and their gradients travel between stages, and the tied
embedding/head gradient of the first and last stage is summed at the end. Backward runs the
micro-batches in ascending order on every stage, like the sequential executor, so the
gradients are bitwise those of one process wherever the arithmetic is the same.

Both offer `forward_only(micro, out_fn, module)`: a pass without gradients (e.g. DPO reference
log-probs through a frozen copy, or with LoRA adapters switched off) whose
`out_fn(HeadInput(hidden, module), mb)` results come back in micro-batch order (on the last
stage; None on the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import paddle

from flashcp.distributed import ParallelGroups
from flashcp.models import HeadInput
from flashcp.pipeline.runner import MicroBatch, PipelineSchedule
from flashcp.pipeline.stage import PipelineStage


def _check_head(model: paddle.nn.Layer) -> None:
    if not callable(getattr(model, "token_logprobs", None)):
        raise TypeError(
            f"the executor's model must carry the LM head (a CausalLM: `model(...)` returns "
            f"final-norm hidden states, `model.token_logprobs(hidden, labels)` the log-probs); "
            f"{type(model).__name__} has no token_logprobs"
        )


class SequentialExecutor:
    """pp = 1: micro-batches one after the other through the whole model."""

    def __init__(self, model: paddle.nn.Layer, forward_context: Callable[[], Any]) -> None:
        _check_head(model)
        self.model = model
        self.forward_context = forward_context

    def train(self, micro: Sequence[MicroBatch]) -> list[float]:
        """Forward + loss + backward per micro-batch; returns each micro-batch's loss."""
        losses = []
        for mb in micro:
            if mb.loss is None:
                raise ValueError("the trainer's micro-batches carry their loss closure")
            with self.forward_context():
                hidden = self.model(mb.input_ids, mb.positions, mb.attn)
                loss = mb.loss(HeadInput(hidden, self.model))
            del hidden
            loss.backward()
            losses.append(float(loss))
        return losses

    def forward_only(
        self,
        micro: Sequence[MicroBatch],
        out_fn: Callable[[HeadInput, MicroBatch], Any],
        module: paddle.nn.Layer | None = None,
    ) -> list[Any]:
        model = module if module is not None else self.model
        _check_head(model)
        out = []
        with paddle.no_grad():
            for mb in micro:
                with self.forward_context():
                    hidden = model(mb.input_ids, mb.positions, mb.attn)
                    out.append(out_fn(HeadInput(hidden, model), mb))
        return out


class PipelineExecutor:
    """pp > 1: this rank's stage under the pipeline schedule `kind` over `groups.pp`."""

    def __init__(
        self,
        stage: PipelineStage,
        groups: ParallelGroups,
        *,
        kind: str,
        forward_context: Callable[[], Any],
    ) -> None:
        self.stage = stage
        self.schedule = PipelineSchedule(stage, groups, kind=kind, forward_context=forward_context)

    def train(self, micro: Sequence[MicroBatch]) -> list[float]:
        """The step's passes; returns the micro-batch losses on the last stage, [] elsewhere."""
        result = self.schedule.run(micro, num_targets=1, broadcast_loss=False)
        return result.micro_losses if self.stage.is_last else []

    def forward_only(
        self,
        micro: Sequence[MicroBatch],
        out_fn: Callable[[HeadInput, MicroBatch], Any],
        module: paddle.nn.Layer | None = None,
    ) -> list[Any] | None:
        stage = module if module is not None else self.stage
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"forward_only needs a PipelineStage, got {type(stage).__name__}")
        return self.schedule.forward_only(micro, out_fn, module=stage)
