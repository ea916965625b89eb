"""What every causal LM here shares: embeddings, the layer loop (with recompute), the head.

`CausalLM.forward(input_ids, positions, attn)` takes this rank's tokens `[B, L_local]`, their
GLOBAL positions `[B, L_local]` and an `AttentionContext`, and returns the FINAL-NORM hidden
states `[B, L_local, H]`, not logits. The LM head is applied by whoever needs it (`LMHead`):

    hidden = model(input_ids, positions, attn)
    logp = model.token_logprobs(hidden, labels, chunk_tokens=4096)  # [B, L_local], chunked
    logits = model.logits(hidden)                                    # full float32 [B, L_local, V]

Training losses use `token_logprobs`, which never holds more than one chunk of float32 logits
(`flashcp.models.head`); the last pipeline stage returns the same hidden states and the
executor hands them, with the stage as the head, to the recipe's loss (`HeadInput`).
Parameter names mirror the Hugging Face layout (`model.embed_tokens`, `model.layers.{i}`,
`model.norm`, `lm_head`) so checkpoints map by name.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle
from paddle import nn

from flashcp.models.attention import Attention, AttentionContext
from flashcp.models.config import ModelArgs
from flashcp.models.head import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_token_logprobs,
)
from flashcp.models.layers import RotaryTables, embedding, linear, rotary_tables
from flashcp.models.recompute import checkpoint


class DecoderLayer(nn.Layer):
    """A layer maps hidden `[B, L, H]` to hidden; subclasses own `self_attn`."""

    self_attn: Attention

    def forward(  # type: ignore[override]
        self, h: paddle.Tensor, rotary: RotaryTables | None, attn: AttentionContext
    ) -> paddle.Tensor:
        raise NotImplementedError


class DecoderOps:
    """The compute shared by `DecoderStack` and a pipeline stage's body (`flashcp.parallel`).

    A host defines `args`, `embed_tokens` (and `embed_positions` with learned positions),
    `norm`, and `layer(i)` returning decoder layer `i` by its GLOBAL index; the methods below
    then run the embeddings and any contiguous slice of layers exactly as the whole model does,
    so a pipeline stage computes bitwise the same values as one process.
    """

    args: ModelArgs

    def layer(self, index: int) -> DecoderLayer:
        raise NotImplementedError

    def embed(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """Token (plus learned position) embeddings `[B, L, H]`; positions are GLOBAL."""
        h = self.embed_tokens(input_ids)  # type: ignore[attr-defined]
        if self.args.uses_learned_positions:
            top = int(positions.max())
            if top >= self.args.max_seq_len:
                raise ValueError(
                    f"position {top} >= model.max_seq_len {self.args.max_seq_len}: learned "
                    "position embeddings only cover max_seq_len positions"
                )
            h = h + self.embed_positions(positions)  # type: ignore[attr-defined]
        return h

    def run_layers(
        self,
        h: paddle.Tensor,
        positions: paddle.Tensor,
        attn: AttentionContext,
        start: int = 0,
        stop: int | None = None,
    ) -> paddle.Tensor:
        """Decoder layers `start .. stop-1` (global indices) on hidden `h`, with the model's
        recompute mode while gradients are recorded (none under `paddle.no_grad`)."""
        args = self.args
        stop = args.num_layers if stop is None else stop
        rotary = None
        if not args.uses_learned_positions:
            rotary = rotary_tables(
                positions, args.rotary_dim, args.rotary_base, interleaved=args.interleaved_rotary
            )
        mode = args.recompute if paddle.is_grad_enabled() else "none"
        for index in range(start, stop):
            layer = self.layer(index)
            if mode == "none":
                h = layer(h, rotary, attn)
            else:
                h = checkpoint(_bind(layer, rotary, attn), h, mode)
        return h


class DecoderStack(DecoderOps, nn.Layer):
    """`model.*`: token (and learned position) embeddings, decoder layers, final norm."""

    def __init__(
        self,
        args: ModelArgs,
        make_layer: Callable[[ModelArgs, int], DecoderLayer],
        make_norm: Callable[[int, float], nn.Layer],
    ) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = embedding(args.vocab_size, args.hidden_size, std=args.initializer_range)
        if args.uses_learned_positions:
            self.embed_positions = embedding(
                args.max_seq_len, args.hidden_size, std=args.initializer_range
            )
        self.layers = nn.LayerList([make_layer(args, i) for i in range(args.num_layers)])
        self.norm = make_norm(args.hidden_size, args.norm_eps)

    def layer(self, index: int) -> DecoderLayer:
        return self.layers[index]

    def forward(
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        h = self.run_layers(self.embed(input_ids, positions), positions, attn)
        return self.norm(h)


def _bind(layer: DecoderLayer, rotary: RotaryTables | None, attn: AttentionContext):
    def run(h: paddle.Tensor) -> paddle.Tensor:
        return layer(h, rotary, attn)

    return run


class LMHead:
    """The LM head (a Linear `lm_head`, or the tied embedding matrix when `lm_head` is None) on
    final-norm hidden states, shared by `CausalLM` and the last pipeline stage. The host has
    `model.embed_tokens` and `lm_head`."""

    model: nn.Layer
    lm_head: nn.Linear | None

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """LM head on final-norm hidden states `[..., H]`, as float32 logits `[..., V]`."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.weight
            if weight.dtype != hidden.dtype:  # e.g. bf16-stored weights, float32 compute
                weight = weight.astype(hidden.dtype)
            out = paddle.matmul(hidden, weight, transpose_y=True)
        else:
            out = self.lm_head(hidden)
        return out.astype("float32")

    def token_logprobs(
        self,
        hidden: paddle.Tensor,
        labels: paddle.Tensor,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        ignore_index: int = IGNORE_INDEX,
    ) -> paddle.Tensor:
        """log p(label) per token, float32 `[B, L]` (0 where `labels == ignore_index`), over
        chunks of `chunk_tokens` target tokens whose logits are recomputed in backward, so no
        `[tokens, V]` float32 tensor exists (`flashcp.models.head`); 0 = the full logits."""
        return chunked_token_logprobs(
            self.logits, hidden, labels, chunk_tokens=chunk_tokens, ignore_index=ignore_index
        )


class CausalLM(LMHead, nn.Layer):
    """Backbone (`self.model`) plus LM head (`self.lm_head`, or the tied embedding)."""

    def __init__(
        self,
        args: ModelArgs,
        make_layer: Callable[[ModelArgs, int], DecoderLayer],
        make_norm: Callable[[int, float], nn.Layer],
    ) -> None:
        super().__init__()
        self.args = args.check()
        self.model = DecoderStack(args, make_layer, make_norm)
        self.lm_head: nn.Linear | None = None
        if not args.tie_embeddings:
            self.lm_head = linear(
                args.hidden_size, args.vocab_size, bias=False, std=args.initializer_range
            )

    def hidden_states(
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        """Final-norm hidden states `[B, L_local, H]`."""
        self._check_inputs(input_ids, positions, attn)
        return self.model(input_ids, positions, attn)

    def forward(  # type: ignore[override]
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        """Final-norm hidden states `[B, L_local, H]` (apply `logits` / `token_logprobs`)."""
        return self.hidden_states(input_ids, positions, attn)

    # ------------------------------------------------------------------ helpers

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def _check_inputs(self, input_ids, positions, attn) -> None:
        if not isinstance(attn, AttentionContext):
            raise TypeError(f"attn must be an AttentionContext, got {type(attn).__name__}")
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(t, paddle.Tensor) or len(t.shape) != 2:
                got = list(t.shape) if isinstance(t, paddle.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a [batch, local_seq] int64 tensor, got {got}")
            if t.dtype not in (paddle.int64, paddle.int32):
                raise TypeError(f"{name} must be int64, got {t.dtype}")
        if list(input_ids.shape) != list(positions.shape):
            raise ValueError(
                f"positions {list(positions.shape)} must match input_ids {list(input_ids.shape)}"
                " (one GLOBAL position per local token)"
            )
