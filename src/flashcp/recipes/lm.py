"""The language-modelling recipes: `pretrain` (every token) and `sft` (response tokens).

Data: `flashcp.data.TrainData` (documents packed into causal-document sequences, labels shifted
on the full sequence). Loss of a micro-batch: the SUM of this rank's token cross-entropies,
which the trainer divides by the GLOBAL target count of the step (every micro-batch, every cp
and dp rank: `count`), so the micro-batch losses of all ranks add up to the mean loss of one
big batch. The cross-entropies come from the last stage's hidden states over chunks of
`train.loss_chunk_tokens` tokens (`HeadInput.token_logprobs`), never from full logits. With a
`lora` section (sft) only the adapters train.

Statistics: the summed cross-entropy and the target tokens of this rank's shard; summed over
every rank they give the token-weighted mean loss and its perplexity (the eval metrics; a
training step reports its own loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import paddle

from flashcp.config import IGNORE_INDEX
from flashcp.data import TrainData
from flashcp.models import DEFAULT_LOSS_CHUNK_TOKENS, HeadInput
from flashcp.pipeline.runner import MicroBatch
from flashcp.recipes.base import Recipe


def summed_cross_entropy(
    out: HeadInput, labels: paddle.Tensor, *, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS
) -> paddle.Tensor:
    """Cross-entropy summed over the tokens with a label (`IGNORE_INDEX` excluded), the head
    run over chunks of `chunk_tokens` target tokens (0: the full logits)."""
    logp = out.token_logprobs(labels, chunk_tokens=chunk_tokens, ignore_index=IGNORE_INDEX)
    return -logp.sum()


class LMData(TrainData):
    """`TrainData` with the `describe()` the trainer's banner uses."""

    def describe(self) -> str:
        out = f"data {self.source.name}: {self.num_documents} docs, {self.num_tokens} tokens"
        skipped = self.bad_records.summary()
        return f"{out} ({skipped})" if skipped else out


class LMRecipe(Recipe):
    """Next-token cross-entropy on the targets of packed documents (pretrain / sft)."""

    name = "pretrain"
    data_class = LMData
    stats = ("nll", "targets")

    def loss(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, list[Any]]:
        """Summed cross-entropy of this rank's tokens; stats: it and their target count."""
        labels = mb.labels
        assert labels is not None  # a trained micro-batch has labels
        nll = summed_cross_entropy(out, labels, chunk_tokens=self.cfg.train.loss_chunk_tokens)
        return nll, [nll.detach(), (labels != IGNORE_INDEX).astype("int64").sum()]

    def finish(self, sums: Sequence[float]) -> dict[str, float]:
        """Token-weighted mean cross-entropy, its perplexity, the target count."""
        nll, targets = float(sums[0]), float(sums[1])
        loss = nll / max(targets, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "targets": targets}


class SFTRecipe(LMRecipe):
    """Cross-entropy on response tokens only (prompt/response JSONL; see `flashcp.data`)."""

    name = "sft"
