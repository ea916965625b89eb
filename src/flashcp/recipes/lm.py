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

from flashcp.config import IGNORE_INDEX, Config
from flashcp.data import TrainData
from flashcp.distributed import ParallelGroups
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
    """Next-token cross-entropy on the targets of packed documents (pretrain / sft).

    With trained MTP layers (`model.mtp_loss_weight` λ > 0, `flashcp.models.mtp`) the loss
    adds λ/D times the MTP cross-entropy summed over depths and tokens: divided by the step's
    one normaliser (the main targets), that is λ times the mean over depths of each depth's
    per-token loss, up to the d targets per document a depth d has fewer. One normaliser keeps
    every micro-batch's loss a plain sum over ranks. The step's `loss` is then that objective;
    `lm_loss` and `mtp_loss` (per-token mean over depths) are reported beside it.
    """

    name = "pretrain"
    data_class = LMData
    stats = ("nll", "targets")

    def __init__(self, cfg: Config, groups: ParallelGroups) -> None:
        super().__init__(cfg, groups)
        self.mtp_weight = float(cfg.model.mtp_loss_weight) if cfg.model.mtp_trained else 0.0
        if self.mtp_weight:
            self.stats = (*type(self).stats, "mtp_nll", "mtp_targets")
            self.step_metrics = ("lm_loss", "mtp_loss")

    def loss(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, list[Any]]:
        """Summed cross-entropy of this rank's tokens (plus λ/D × the MTP depths'); stats: it
        and their target count (and the MTP depths' summed cross-entropy and targets)."""
        labels = mb.labels
        assert labels is not None  # a trained micro-batch has labels
        chunk = self.cfg.train.loss_chunk_tokens
        nll = summed_cross_entropy(out, labels, chunk_tokens=chunk)
        stats: list[Any] = [nll.detach(), (labels != IGNORE_INDEX).astype("int64").sum()]
        if not self.mtp_weight:
            return nll, stats
        if mb.mtp_ids is None or mb.mtp_labels is None:
            raise ValueError("model.mtp_loss_weight > 0 but the micro-batch has no MTP targets")
        logps = out.mtp_token_logprobs(
            mb.mtp_ids, mb.mtp_labels, mb.positions, mb.attn, chunk_tokens=chunk
        )
        mtp_nll = -paddle.add_n([lp.sum() for lp in logps])
        mtp_targets = (mb.mtp_labels != IGNORE_INDEX).astype("int64").sum()
        loss = nll + (self.mtp_weight / len(logps)) * mtp_nll
        return loss, [*stats, mtp_nll.detach(), mtp_targets]

    def finish(self, sums: Sequence[float]) -> dict[str, float]:
        """Token-weighted mean cross-entropy, its perplexity, the target count (with MTP:
        `lm_loss` = that mean, `mtp_loss` = the MTP depths' per-token mean)."""
        nll, targets = float(sums[0]), float(sums[1])
        loss = nll / max(targets, 1.0)
        out = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "targets": targets}
        if len(sums) > 2:
            out["lm_loss"] = loss
            out["mtp_loss"] = float(sums[2]) / max(float(sums[3]), 1.0)
        return out


class SFTRecipe(LMRecipe):
    """Cross-entropy on response tokens only (prompt/response JSONL; see `flashcp.data`)."""

    name = "sft"
