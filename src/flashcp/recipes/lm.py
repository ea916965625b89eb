"""The language-modelling recipes: `pretrain` (every token) and `sft` (response tokens).

Data: `flashcp.data.TrainData` (documents packed into causal-document sequences, labels shifted
on the full sequence). Loss of a micro-batch: the SUM of this rank's token cross-entropies
divided by the GLOBAL target count of the step (every micro-batch, summed over cp and dp), so
the micro-batch losses of all ranks add up to the mean loss of one big batch. The
cross-entropies come from the last stage's hidden states over chunks of
`train.loss_chunk_tokens` tokens (`HeadInput.token_logprobs`), never from full logits. With a
`lora` section (sft) only the adapters train.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
import paddle

from flashcp.attention.context import AttentionContext
from flashcp.config import IGNORE_INDEX
from flashcp.cp.shard import shard_batch
from flashcp.data import TrainData
from flashcp.models import DEFAULT_LOSS_CHUNK_TOKENS, HeadInput
from flashcp.optim.grads import all_reduce_values
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.recipes.base import Recipe, StepPlan


def summed_cross_entropy(
    out: HeadInput, labels: paddle.Tensor, *, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS
) -> paddle.Tensor:
    """Cross-entropy summed over the tokens with a label (`IGNORE_INDEX` excluded), the head
    run over chunks of `chunk_tokens` target tokens (0: the full logits)."""
    logp = out.token_logprobs(labels, chunk_tokens=chunk_tokens, ignore_index=IGNORE_INDEX)
    return -logp.sum()


def normalised_ce(
    out: HeadInput, *, labels: paddle.Tensor, denom: float, chunk_tokens: int
) -> paddle.Tensor:
    """`summed_cross_entropy / denom` (denom: the step's global target count)."""
    return summed_cross_entropy(out, labels, chunk_tokens=chunk_tokens) / denom


class LMData(TrainData):
    """`TrainData` with the `describe()` the trainer's banner uses."""

    def describe(self) -> str:
        out = f"data {self.source.name}: {self.num_documents} docs, {self.num_tokens} tokens"
        skipped = self.bad_records.summary()
        return f"{out} ({skipped})" if skipped else out


class LMRecipe(Recipe):
    """Next-token cross-entropy on the targets of packed documents (pretrain / sft)."""

    name = "pretrain"

    def build_data(self) -> LMData:
        ctx = self.ctx
        return LMData(self.cfg, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, peers=ctx.data_peers())

    def setup_model(self, model: paddle.nn.Layer) -> None:
        self.apply_lora(model)

    def plan(self, batches: list[Any]) -> StepPlan:
        ctx, cfg = self.ctx, self.cfg
        locals_ = [shard_batch(b, ctx.cp_rank, ctx.assignment_for(b)) for b in batches]
        counts = all_reduce_values(
            [sum(int((lb.labels != IGNORE_INDEX).sum()) for lb in locals_)],
            [ctx.groups.cp, ctx.groups.dp],
        )
        targets = int(round(counts[0]))
        denom = float(max(targets, 1))
        micro = []
        for local in locals_:
            labels = paddle.to_tensor(local.labels)
            attn = AttentionContext(
                mask=local.mask.indices,
                causal=local.mask.causal,
                group=ctx.groups.cp,
                assignment=local.assignment,
                mode=cfg.parallel.cp_mode,
                fa4_unavailable=cfg.attention.fa4_unavailable,
            )
            micro.append(
                MicroBatch(
                    paddle.to_tensor(local.input_ids),
                    paddle.to_tensor(local.positions),
                    labels,
                    attn,
                    loss=partial(
                        normalised_ce,
                        labels=labels,
                        denom=denom,
                        chunk_tokens=cfg.train.loss_chunk_tokens,
                    ),
                )
            )
        seq_len = batches[0].seq_len if batches else 0
        tokens = ctx.dp_size * cfg.train.grad_accum * cfg.data.micro_batch_size * seq_len
        return StepPlan(micro=micro, tokens=tokens, targets=targets)

    def eval_sums(
        self, batches: list[Any], runner: PipelineRunner, module: paddle.nn.Layer
    ) -> list[float]:
        """[summed cross-entropy, target tokens] of this rank's tokens (its cp shard, last
        pipeline stage; 0 elsewhere): summed over every rank, a token-weighted mean."""
        chunk = self.cfg.train.loss_chunk_tokens

        def sums(out: HeadInput, mb: MicroBatch) -> tuple[float, int]:
            nll = summed_cross_entropy(out, mb.labels, chunk_tokens=chunk)
            return float(nll), int((mb.labels != IGNORE_INDEX).astype("int64").sum())

        results = runner.forward_only(self.plan(batches).micro, sums) or []
        return [sum(r[0] for r in results), float(sum(r[1] for r in results))]

    def eval_metrics(self, sums: np.ndarray) -> dict[str, float]:
        """Token-weighted mean cross-entropy over the eval set, its perplexity, the count."""
        nll, targets = float(sums[0]), float(sums[1])
        loss = nll / max(targets, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "targets": targets}


class SFTRecipe(LMRecipe):
    """Cross-entropy on response tokens only (prompt/response JSONL; see `flashcp.data`)."""

    name = "sft"
