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
from flashcp.models.base import CausalLM, DecoderLayer
from flashcp.models.layers import RotaryTables, rotary_tables
from flashcp.models.recompute import checkpoint


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_layers(
    num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """The global layer indices of each of the `pp` stages, contiguous and in order.

    `layers_per_stage` (config `parallel.pp_layers`) gives the count per stage explicitly;
    None splits evenly with the extras on the earliest stages (see the module docstring).
    Raises `ValueError` naming the config key at fault.
    """
    if not _is_int(pp) or pp < 1:
        raise ValueError(f"parallel.pp must be an integer >= 1, got {pp!r}")
    if not _is_int(num_layers) or num_layers < 1:
        raise ValueError(f"model.num_layers must be an integer >= 1, got {num_layers!r}")
    if layers_per_stage is None:
        if num_layers < pp:
            raise ValueError(
                f"num_layers {num_layers} < pp {pp}: each stage needs at least one layer "
                f"(lower parallel.pp to at most {num_layers} or add layers)"
            )
        base, extra = divmod(num_layers, pp)
        counts = [base + (1 if s < extra else 0) for s in range(pp)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != pp:
            raise ValueError(
                f"parallel.pp_layers {counts} has {len(counts)} entries but parallel.pp is "
                f"{pp}: give one layer count per stage"
            )
        for s, n in enumerate(counts):
            if not _is_int(n) or n < 1:
                raise ValueError(
                    f"parallel.pp_layers {counts}: stage {s} has {n!r} layers; each stage "
                    "needs an integer >= 1"
                )
        if sum(counts) != num_layers:
            raise ValueError(
                f"parallel.pp_layers {counts} sums to {sum(counts)} but model.num_layers is "
                f"{num_layers}"
            )
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


class _StageBody(nn.Layer):
    """Holder so parameter names read `model.<...>` as in the full model."""


class PipelineStage(nn.Layer):
    """Stage `stage` of `num_stages`: embeddings (first), layers `layer_range`, head (last).

    `forward(x, positions, attn)` takes token ids `[B, L]` on the first stage and the previous
    stage's hidden states `[B, L, H]` elsewhere; it returns hidden states `[B, L, H]`, or on
    the last stage float32 logits `[B, L, V]`. `positions` are the GLOBAL positions of the
    local tokens (every stage needs them for rotary); `attn` carries the mask and CP group.
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
        self.model = _StageBody()
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
        h = self.model.embed_tokens(input_ids)
        if self.args.uses_learned_positions:
            top = int(positions.max())
            if top >= self.args.max_seq_len:
                raise ValueError(
                    f"position {top} >= model.max_seq_len {self.args.max_seq_len}: learned "
                    "position embeddings only cover max_seq_len positions"
                )
            h = h + self.model.embed_positions(positions)
        return h

    def run_layers(
        self, h: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        """This stage's decoder layers (with the model's recompute mode) on hidden `h`."""
        args = self.args
        rotary = None
        if not args.uses_learned_positions:
            rotary = rotary_tables(
                positions, args.rotary_dim, args.rotary_base, interleaved=args.interleaved_rotary
            )
        mode = args.recompute if paddle.is_grad_enabled() else "none"
        for layer in self.decoder_layers():
            if mode == "none":
                h = layer(h, rotary, attn)
            else:
                h = checkpoint(_bind(layer, rotary, attn), h, mode)
        return h

    def head(self, h: paddle.Tensor) -> paddle.Tensor:
        """Last stage: final norm and LM head (or the tied embedding), float32 logits."""
        h = self.model.norm(h)
        if self.lm_head is None:
            out = paddle.matmul(h, self.model.embed_tokens.weight, transpose_y=True)
        else:
            out = self.lm_head(h)
        return out.astype("float32")

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
        return self.head(h) if self.is_last else h

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


def _bind(layer: DecoderLayer, rotary: RotaryTables | None, attn: AttentionContext):
    def run(h: paddle.Tensor) -> paddle.Tensor:
        return layer(h, rotary, attn)

    return run
