"""One pipeline stage: a contiguous slice of a `CausalLM`'s decoder layers.

`split_layers` decides which layers each stage runs; `PipelineStage` wraps the slice of an
already-built model, so every stage starts from exactly the weights a single-process model
built with the same seed has (build the full model on every rank, keep one stage; the rest is
freed with the model). Stage 0 also owns the token (and learned position) embeddings; the last
stage owns the final norm, the LM head and the loss.

Default split: as even as possible, the extra layers going to the EARLIEST stages, so the last
stage (which also runs the LM head and the loss over the vocabulary, the largest matmul and
logits buffer of the step) gets the fewest, e.g. 5 layers on 2 stages -> [3, 2], 4 on 3 ->
[2, 1, 1]. Under 1F1B the early stages keep more micro-batches in flight, so when activation
memory rather than the head dominates, set `parallel.pp_layers` explicitly.

Tied embeddings (`model.tie_embeddings`) under pp > 1: the first stage uses the matrix as the
embedding and the last stage as the LM head, each holding its own copy (identical at build
time). `PipelineStage.tied_weight` names that copy and the schedule adds the two stages'
gradients (`flashcp.parallel.pipeline.sync_tied_gradients`) so both copies receive the full
gradient and stay equal under any optimizer step (the Megatron approach).

Parameter names are the full model's (`model.embed_tokens.weight`, `model.layers.3.mlp...`,
`model.norm.weight`, `lm_head.weight`): the layers live in a `LayerDict` keyed by their GLOBAL
index, so checkpoints and gradient comparisons map by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import paddle
from paddle import nn

from flashcp.models.attention import AttentionContext
from flashcp.models.base import CausalLM, DecoderLayer, DecoderOps, LMHead
from flashcp.parallel.split import split_layers


class _StageBody(DecoderOps, nn.Layer):
    """`model.*` of a stage, so parameter names read as in the full model; runs its slice of
    layers with the same `DecoderOps` code as the full model's `DecoderStack`."""

    def __init__(self, args, layer_range: range) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.args = args
        self.layer_range = layer_range

    def layer(self, index: int) -> DecoderLayer:
        if index not in self.layer_range:
            raise IndexError(f"layer {index} is not on this stage (layers {self.layer_range})")
        return self.layers[str(index)]


class PipelineStage(LMHead, nn.Layer):
    """Stage `stage` of `num_stages`: embeddings (first), layers `layer_range`, head (last).

    `forward(x, positions, attn)` takes token ids `[B, L]` on the first stage and the previous
    stage's hidden states `[B, L, H]` elsewhere; it returns hidden states `[B, L, H]`, on the
    last stage after the final norm (as `CausalLM.forward`): the LM head runs in the loss, over
    token chunks (`LMHead.token_logprobs`, reached through `flashcp.models.HeadInput`).
    `positions` are the GLOBAL positions of the local tokens (every stage needs them for
    rotary); `attn` carries the mask and CP group.
    """

    def __init__(self, model: CausalLM, stage: int, num_stages: int, layer_range: range) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
        total = len(model.model.layers)
        if layer_range.step != 1 or not 0 <= layer_range.start < layer_range.stop <= total:
            raise ValueError(
                f"layer range {layer_range} is not a non-empty contiguous slice of the "
                f"model's {total} layers"
            )
        self.args = model.args
        self.stage = stage
        self.num_stages = num_stages
        self.layer_range = layer_range
        stack = model.model
        self.model = _StageBody(self.args, layer_range)
        tied = model.lm_head is None
        if self.is_first or (self.is_last and tied):
            self.model.embed_tokens = stack.embed_tokens
        if self.is_first and self.args.uses_learned_positions:
            self.model.embed_positions = stack.embed_positions
        self.model.layers = nn.LayerDict({str(i): stack.layers[i] for i in layer_range})
        self.lm_head: nn.Linear | None = None
        if self.is_last:
            self.model.norm = stack.norm
            self.lm_head = model.lm_head

    # ------------------------------------------------------------------ facts

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def tied_weight(self) -> paddle.Tensor | None:
        """The embedding/head matrix whose gradient the first and last stages must add.

        None unless embeddings are tied, pp > 1 and this is the first or last stage.
        """
        if self.num_stages == 1 or not self.args.tie_embeddings:
            return None
        if self.is_first or self.is_last:
            return self.model.embed_tokens.weight
        return None

    @property
    def activation_dtype(self) -> paddle.dtype:
        """dtype of the hidden states passed between stages (the layers' parameter dtype)."""
        first = next(iter(self.model.layers.values()))
        return next(iter(first.parameters())).dtype

    def activation_shape(self, tokens_shape: Sequence[int]) -> list[int]:
        """`[B, L, H]` of the hidden states for a micro-batch of token shape `[B, L]`."""
        batch, length = (int(d) for d in tokens_shape)
        return [batch, length, int(self.args.hidden_size)]

    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers, in order."""
        return [self.model.layers[str(i)] for i in self.layer_range]

    # ------------------------------------------------------------------ compute

    def embed(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """First stage: token (+ learned position) embeddings, as `DecoderStack` computes them."""
        return self.model.embed(input_ids, positions)

    def run_layers(
        self, h: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        """This stage's decoder layers (with the model's recompute mode) on hidden `h`."""
        r = self.layer_range
        return self.model.run_layers(h, positions, attn, r.start, r.stop)

    def forward(  # type: ignore[override]
        self, x: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        if not isinstance(attn, AttentionContext):
            raise TypeError(f"attn must be an AttentionContext, got {type(attn).__name__}")
        expected = 2 if self.is_first else 3
        if len(x.shape) != expected:
            what = "token ids [B, L]" if self.is_first else "hidden states [B, L, H]"
            raise ValueError(f"stage {self.stage} takes {what}, got shape {list(x.shape)}")
        if list(positions.shape) != list(x.shape[:2]):
            raise ValueError(
                f"positions {list(positions.shape)} must match the tokens {list(x.shape[:2])}"
            )
        h = self.embed(x, positions) if self.is_first else x
        h = self.run_layers(h, positions, attn)
        return self.model.norm(h) if self.is_last else h

    @classmethod
    def from_model(
        cls,
        model: CausalLM,
        stage: int,
        num_stages: int,
        layers_per_stage: Sequence[int] | None = None,
    ) -> PipelineStage:
        """Stage `stage` of `model` split by `split_layers` (`layers_per_stage`: pp_layers)."""
        ranges = split_layers(model.args.num_layers, num_stages, layers_per_stage)
        return cls(model, stage, num_stages, ranges[stage])

    def extra_repr(self) -> str:
        r = self.layer_range
        return f"stage={self.stage}/{self.num_stages}, layers=[{r.start}, {r.stop})"
