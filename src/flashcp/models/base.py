"""What every causal LM here shares: embeddings, the layer loop (with recompute), the head,
and the pipeline-stage view of all that (a `CausalLM` built for a `StageSpec` holds only its
stage's parts; a one-stage pipeline is the whole model).

`CausalLM.forward(input_ids, positions, attn)` takes this rank's tokens `[B, L_local]`, their
GLOBAL positions `[B, L_local]` and an `AttentionContext`, and returns the FINAL-NORM hidden
states `[B, L_local, H]` (on the last stage; earlier stages return the hidden states they pass
on), not logits. The LM head is applied by whoever needs it (`LMHead`):

    hidden = model(input_ids, positions, attn)
    logp = model.token_logprobs(hidden, labels, chunk_tokens=4096)  # [B, L_local], chunked
    logits = model.logits(hidden)                                    # full float32 [B, L_local, V]

Training losses use `token_logprobs`, which never holds more than one chunk of float32 logits
(`flashcp.models.head`); the runner hands the last stage's hidden states, with the stage as
the head, to the recipe's loss (`HeadInput`). Parameter names mirror the Hugging Face layout
(`model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`) so checkpoints map by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import paddle
from paddle import nn

from flashcp.attention.context import AttentionContext
from flashcp.models.attention import Attention
from flashcp.models.config import ModelArgs
from flashcp.models.head import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_token_logprobs,
)
from flashcp.models.layers import RotaryTables, embedding, linear, rotary_tables
from flashcp.models.mtp import add_mtp_parts, mtp_block_input
from flashcp.models.offload import ActivationOffloader
from flashcp.models.precision import cast_linear
from flashcp.models.recompute import checkpoint
from flashcp.models.rope import model_inverse_frequencies
from flashcp.models.tiling import tiled


class DecoderLayer(nn.Layer):
    """A layer maps hidden `[B, L, H]` to hidden: the token-wise `before` (input norm, q/k/v
    projections, QK-norm, rotary), attention (the only part that mixes tokens), and the
    token-wise `after` (o_proj, norms, residuals, MLP or MoE) a family defines.

    With `tile_tokens` > 0 (`model.tile_tokens`) `before` and `after` run over tiles of that
    many local tokens (`flashcp.models.tiling`); 0 runs them once over all local tokens.
    """

    self_attn: Attention
    input_layernorm: nn.Layer
    tile_tokens: int = 0
    residual_dtype: str = "float32"
    """`model.residual_dtype`: the dtype of the layer's input and output (the stream)."""

    def before(
        self, h: paddle.Tensor, rotary: RotaryTables | None
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """q, k, v of hidden `h` (token-wise)."""
        return self.self_attn.project(self.input_layernorm(h), rotary)

    def after(self, h: paddle.Tensor, o: paddle.Tensor, attn: AttentionContext) -> paddle.Tensor:
        """The layer output from its input `h` and the attention output `o` (token-wise)."""
        raise NotImplementedError

    def forward(  # type: ignore[override]
        self, h: paddle.Tensor, rotary: RotaryTables | None, attn: AttentionContext
    ) -> paddle.Tensor:
        """The layer on the residual stream `h` (in `residual_dtype`), computing in float32.

        Untiled, `h` is upcast once on entry and the output rounded on exit, so the gradient
        reaching `h` is rounded once. Tiled, each tile is upcast inside the tiled blocks (a
        tiled layer never holds a full-length float32 copy of its input, `flashcp.plan`'s
        `layer_working_set`): `before` and `after` then each round their part of `h`'s
        gradient, and the two parts are summed in `residual_dtype`.
        """
        tile, stream = self.tile_tokens, self.residual_dtype
        if not 0 < tile < int(h.shape[1]):
            h = from_residual(h)  # one upcast; the blocks' `from_residual` are then no ops
        if rotary is None:
            qkv = tiled(lambda x: self.before(from_residual(x), None), [h], tile)
        else:

            def before(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor):
                return self.before(from_residual(x), replace(rotary, cos=cos, sin=sin))

            qkv = tiled(before, [h], tile, tables=(rotary.cos, rotary.sin))
        o = self.self_attn.core(*qkv, attn)
        del qkv  # without gradients (recompute's first pass, DPO's reference) q, k, v die here

        def after(x: paddle.Tensor, y: paddle.Tensor) -> tuple[paddle.Tensor]:
            out = self.after(from_residual(x), y, attn)
            return (out if stream == "float32" else out.astype(stream),)

        return tiled(after, [h, o], tile)[0]


class DecoderOps:
    """The compute of `DecoderStack` (the whole model's or a pipeline stage's `model.*`).

    A host defines `args`, `recompute` (its activation recompute mode), `embed_tokens` (and
    `embed_positions` with learned positions), `norm`, and `layer(i)` returning decoder layer
    `i` by its GLOBAL index; the methods below
    then run the embeddings and any contiguous slice of layers exactly as the whole model does,
    so a pipeline stage computes bitwise the same values as one process.
    """

    args: ModelArgs
    recompute: str
    offloader: ActivationOffloader | None = None
    """Set by `flashcp.models.offload.apply_activation_offload` (`train.offload_activations`):
    recomputed layers then keep their inputs on the host."""

    def layer(self, index: int) -> DecoderLayer:
        raise NotImplementedError

    def embed(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """Token (plus learned position) embeddings `[B, L, H]` in the residual dtype;
        positions are GLOBAL."""
        h = self.embed_tokens(input_ids)  # type: ignore[attr-defined]
        if self.args.uses_learned_positions:
            top = int(positions.max())
            if top >= self.args.max_seq_len:
                raise ValueError(
                    f"position {top} >= model.max_seq_len {self.args.max_seq_len}: learned "
                    "position embeddings only cover max_seq_len positions"
                )
            h = h + self.embed_positions(positions)  # type: ignore[attr-defined]
        return to_residual(h, self.args)

    def run_layers(
        self,
        h: paddle.Tensor,
        positions: paddle.Tensor,
        attn: AttentionContext,
        start: int = 0,
        stop: int | None = None,
    ) -> paddle.Tensor:
        """Decoder layers `start .. stop-1` (global indices) on hidden `h`, under the host's
        recompute mode while gradients are recorded (none under `paddle.no_grad`)."""
        stop = self.args.num_layers if stop is None else stop
        rotary = self._rotary(positions)
        mode = self.recompute if paddle.is_grad_enabled() else "none"
        chain = None
        if mode != "none" and self.offloader is not None:
            chain = self.offloader.chain()  # this micro-batch's layers on this stage
        for index in range(start, stop):
            run = _bind(self.layer(index), rotary, attn)
            h = run(h) if mode == "none" else checkpoint(run, h, mode, chain)
        return h

    def run_mtp(
        self,
        hidden: paddle.Tensor,
        ids: paddle.Tensor,
        positions: paddle.Tensor,
        attn: AttentionContext,
    ) -> list[paddle.Tensor]:
        """The MTP layers' block outputs `[B, L, H]`, one per depth (`flashcp.models.mtp`):
        depth d combines the previous depth's hidden states (`hidden`, the final-norm ones,
        for d = 1) with the embeddings of `ids[d-1]` (`[D, B, L]`: token i+d at position i)
        and runs its block under the host's recompute mode (its input kept on the device)."""
        args = self.args
        rotary = self._rotary(positions)
        mode = self.recompute if paddle.is_grad_enabled() else "none"
        outs: list[paddle.Tensor] = []
        for depth in range(args.mtp_layers):
            layer = self.layer(args.num_layers + depth)
            x = to_residual(mtp_block_input(layer, hidden, ids[depth]), args)
            run = _bind(layer, rotary, attn)
            out = run(x) if mode == "none" else checkpoint(run, x, mode, None)
            outs.append(out)
            hidden = from_residual(out)
        return outs

    def _rotary(self, positions: paddle.Tensor) -> RotaryTables | None:
        args = self.args
        if args.uses_learned_positions:
            return None
        return rotary_tables(
            positions, model_inverse_frequencies(args), interleaved=args.interleaved_rotary
        )

    def final_norm(self, h: paddle.Tensor) -> paddle.Tensor:
        """The final norm on the last layer's output (a float32 residual stream into it)."""
        return self.norm(from_residual(h))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one process builds: pipeline stage `index` of `count`, running
    decoder layers `layers` (GLOBAL indices, contiguous). The first stage also holds the
    embeddings, the last the final norm and the LM head; `StageSpec.whole` is everything.

    Under expert parallelism (`ep_size` > 1, MoE models) the stage's MoE layers hold only ep
    rank `ep_rank`'s share of the routed experts (`flashcp.models.expert_parallel`)."""

    index: int
    count: int
    layers: range
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def whole(cls, num_layers: int) -> StageSpec:
        return cls(0, 1, range(0, num_layers))

    def experts(self, num_experts: int) -> range:
        """The routed experts (GLOBAL indices) this stage's MoE layers hold."""
        from flashcp.models.expert_parallel import expert_range

        return expert_range(num_experts, self.ep_size, self.ep_rank)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def check(self, num_layers: int) -> StageSpec:
        """Raise `ValueError` unless this is a valid stage of a `num_layers`-layer model."""
        if not 0 <= self.index < self.count:
            raise ValueError(f"stage {self.index} is outside 0..{self.count - 1}")
        r = self.layers
        if r.step != 1 or not 0 <= r.start < r.stop <= num_layers:
            raise ValueError(
                f"layer range {r} is not a non-empty contiguous slice of the model's "
                f"{num_layers} layers"
            )
        if self.count == 1 and len(r) != num_layers:
            raise ValueError(f"a single stage runs all {num_layers} layers, not {r}")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep rank {self.ep_rank} is outside 0..{self.ep_size - 1}")
        return self


class LayerMap(nn.Layer):
    """Decoder layers keyed by their GLOBAL index (`model.layers.7...` on whichever stage holds
    layer 7); indexing, `len` and iteration work as on the `LayerList` of a whole model."""

    def __init__(self, layers: dict[int, DecoderLayer]) -> None:
        super().__init__()
        self.indices = sorted(layers)
        for i in self.indices:
            self.add_sublayer(str(i), layers[i])

    def __getitem__(self, index: int) -> DecoderLayer:
        if index not in self.indices:
            raise IndexError(f"layer {index} is not on this stage (layers {self.indices})")
        return self._sub_layers[str(index)]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self._sub_layers[str(i)] for i in self.indices)


class DecoderStack(DecoderOps, nn.Layer):
    """`model.*`: token (and learned position) embeddings, decoder layers, final norm — or the
    subset a pipeline stage holds (`layers`, `embed`, `norm`); with the final norm (the last
    stage) also the `model.mtp_layers` MTP layers, `model.layers.{num_layers + d}`."""

    def __init__(
        self,
        args: ModelArgs,
        make_layer: Callable[[ModelArgs, int], DecoderLayer],
        make_norm: Callable[[int, float], nn.Layer],
        *,
        layers: range | None = None,
        embed: bool = True,
        positions: bool = True,
        norm: bool = True,
    ) -> None:
        super().__init__()
        self.args = args
        self.recompute: str = args.recompute
        """`model.recompute`, unless `flashcp.parallelize.apply_recompute` set another."""
        self.layer_range = range(0, args.num_layers) if layers is None else layers
        if embed:
            self.embed_tokens = embedding(
                args.vocab_size, args.hidden_size, std=args.initializer_range
            )
        if positions and args.uses_learned_positions:
            self.embed_positions = embedding(
                args.max_seq_len, args.hidden_size, std=args.initializer_range
            )
        layers = {i: make_layer(args, i) for i in self.layer_range}
        if norm:  # the last stage: its MTP layers follow the last decoder layer
            for index in range(args.num_layers, args.num_layers + args.mtp_layers):
                layers[index] = add_mtp_parts(make_layer(args, index), args, make_norm)
        self.layers = LayerMap(layers)
        if norm:
            self.norm = make_norm(args.hidden_size, args.norm_eps)

    def layer(self, index: int) -> DecoderLayer:
        return self.layers[index]

    def forward(
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        h = self.run_layers(self.embed(input_ids, positions), positions, attn)
        return self.final_norm(h)


def residual_dtype(args: ModelArgs) -> paddle.dtype:
    """`model.residual_dtype` as a Paddle dtype."""
    return paddle.float32 if args.residual_dtype == "float32" else paddle.bfloat16


def to_residual(h: paddle.Tensor, args: ModelArgs) -> paddle.Tensor:
    """`h` rounded to `model.residual_dtype`, the dtype of the residual stream between layers
    (no op at the default float32)."""
    return h if h.dtype == residual_dtype(args) else h.astype(args.residual_dtype)


def from_residual(h: paddle.Tensor) -> paddle.Tensor:
    """The residual stream as the float32 a layer (or the final norm) computes on."""
    return h if h.dtype == paddle.float32 else h.astype("float32")


def _bind(layer: DecoderLayer, rotary: RotaryTables | None, attn: AttentionContext):
    """Layer `layer` as a function of the residual stream (what recompute checkpoints)."""

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
            out = cast_linear(hidden, self.model.embed_tokens.weight, transpose=True)
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
    """A causal LM, or one pipeline stage of it (a one-stage pipeline IS the model).

    `stage` (a `StageSpec`; None = the whole model) decides what is built: embeddings on the
    first stage, decoder layers `stage.layers` by GLOBAL index, final norm and LM head
    (`self.lm_head`, or the tied embedding) on the last. Parameter names are the full model's
    (`model.embed_tokens.weight`, `model.layers.3.mlp...`, `model.norm.weight`,
    `lm_head.weight`), so checkpoints and gradient comparisons map by name.

    `forward(x, positions, attn)` takes token ids `[B, L]` on the first stage and the previous
    stage's hidden states `[B, L, H]` elsewhere; it returns hidden states `[B, L, H]`: after the
    final norm on the last stage (apply `logits` / `token_logprobs`), the layers' output
    elsewhere. `positions` are the GLOBAL positions of the local tokens (every stage needs them
    for rotary); `attn` carries the mask and CP group.

    Tied embeddings (`tie_embeddings`) under pp > 1: the first stage uses the matrix as the
    embedding and the last stage as the LM head, each holding its own copy (equal at build time:
    same name, same init). `tied_weight` names that copy and the pipeline schedule adds the two
    stages' gradients (`flashcp.pipeline.runner.sync_tied_gradients`) so both copies receive
    the full gradient and stay equal under any optimizer step (the Megatron approach).
    """

    def __init__(
        self,
        args: ModelArgs,
        make_layer: Callable[[ModelArgs, int], DecoderLayer],
        make_norm: Callable[[int, float], nn.Layer],
        *,
        stage: StageSpec | None = None,
    ) -> None:
        super().__init__()
        self.args = args.check()
        spec = (stage or StageSpec.whole(args.num_layers)).check(args.num_layers)
        self.spec = spec
        tied = args.tie_embeddings
        self.model = DecoderStack(
            args,
            make_layer,
            make_norm,
            layers=spec.layers,
            embed=spec.is_first or (spec.is_last and tied),
            positions=spec.is_first,
            norm=spec.is_last,
        )
        self.lm_head: nn.Linear | None = None
        if spec.is_last and not tied:
            self.lm_head = linear(
                args.hidden_size, args.vocab_size, bias=False, std=args.initializer_range
            )

    # ------------------------------------------------------------------ stage facts

    @property
    def stage(self) -> int:
        return self.spec.index

    @property
    def num_stages(self) -> int:
        return self.spec.count

    @property
    def layer_range(self) -> range:
        return self.spec.layers

    @property
    def is_first(self) -> bool:
        return self.spec.is_first

    @property
    def is_last(self) -> bool:
        return self.spec.is_last

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
        """dtype of the hidden states passed between stages: the residual stream's,
        `model.residual_dtype` (float32 by default, whatever the storage dtype: the embeddings
        output float32, see `flashcp.models.layers.Embedding`)."""
        return residual_dtype(self.args)

    def activation_shape(self, tokens_shape: Sequence[int]) -> list[int]:
        """`[B, L, H]` of the hidden states for a micro-batch of token shape `[B, L]`."""
        batch, length = (int(d) for d in tokens_shape)
        return [batch, length, int(self.args.hidden_size)]

    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers, in order (the MTP layers not among them)."""
        return [self.model.layers[i] for i in self.layer_range]

    def mtp_layers(self) -> list[DecoderLayer]:
        """This stage's MTP layers by depth (the last stage's `model.mtp_layers`; else none)."""
        if not self.is_last:
            return []
        n = self.args.num_layers
        return [self.model.layers[n + d] for d in range(self.args.mtp_layers)]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.decoder_layers()]

    def mtp_token_logprobs(
        self,
        hidden: paddle.Tensor,
        ids: paddle.Tensor,
        labels: paddle.Tensor,
        positions: paddle.Tensor,
        attn: AttentionContext,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ) -> list[paddle.Tensor]:
        """log p(target) `[B, L_local]` per MTP depth, from the final-norm `hidden`: the MTP
        inputs `ids` and targets `labels` (`[D, B, L_local]`, `flashcp.models.mtp.mtp_targets`
        cut for this rank), each depth's head run in chunks as the main head's."""
        if not self.mtp_layers():
            raise ValueError(
                "MTP log-probs need the MTP layers: the last stage of a model with "
                "model.mtp_layers > 0"
            )
        outs = self.model.run_mtp(hidden, ids, positions, attn)
        return [
            chunked_token_logprobs(
                layer.shared_head.logits, from_residual(out), labels[d], chunk_tokens=chunk_tokens
            )
            for d, (layer, out) in enumerate(zip(self.mtp_layers(), outs, strict=True))
        ]

    # ------------------------------------------------------------------ compute

    def embed(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """First stage: token (+ learned position) embeddings."""
        return self.model.embed(input_ids, positions)

    def hidden_states(
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        """Final-norm hidden states `[B, L_local, H]` (the whole model only)."""
        if self.num_stages != 1:
            raise ValueError("hidden_states needs the whole model; a pipeline stage has forward")
        self._check_inputs(input_ids, positions, attn)
        return self.model(input_ids, positions, attn)

    def forward(  # type: ignore[override]
        self, x: paddle.Tensor, positions: paddle.Tensor, attn: AttentionContext
    ) -> paddle.Tensor:
        if self.is_first:
            self._check_inputs(x, positions, attn)
        else:
            self._check_hidden(x, positions, attn)
        # the embeddings pass as an argument only, so what does not keep them (a forward
        # without gradients, a first layer whose numpy RMSNorm keeps no input) frees them after
        # the first layer: a local here would hold them through every layer's forward
        r = self.layer_range
        h = self.model.run_layers(
            self.embed(x, positions) if self.is_first else x, positions, attn, r.start, r.stop
        )
        return self.model.final_norm(h) if self.is_last else h

    def extra_repr(self) -> str:
        r = self.layer_range
        return f"stage={self.stage}/{self.num_stages}, layers=[{r.start}, {r.stop})"

    # ------------------------------------------------------------------ input checks

    def _check_inputs(self, input_ids, positions, attn) -> None:
        if not isinstance(attn, AttentionContext):
            raise TypeError(f"attn must be an AttentionContext, got {type(attn).__name__}")
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(t, paddle.Tensor) or len(t.shape) != 2:
                got = list(t.shape) if isinstance(t, paddle.Tensor) else type(t).__name__
                where = (
                    f" (stage 0 of {self.num_stages} takes token ids)"
                    if (self.num_stages > 1 and name == "input_ids")
                    else ""
                )
                raise ValueError(
                    f"{name} must be a [batch, local_seq] int64 tensor{where}, got {got}"
                )
            if t.dtype not in (paddle.int64, paddle.int32):
                raise TypeError(f"{name} must be int64, got {t.dtype}")
        if list(input_ids.shape) != list(positions.shape):
            raise ValueError(
                f"positions {list(positions.shape)} must match input_ids {list(input_ids.shape)}"
                " (one GLOBAL position per local token)"
            )

    def _check_hidden(self, x, positions, attn) -> None:
        if not isinstance(attn, AttentionContext):
            raise TypeError(f"attn must be an AttentionContext, got {type(attn).__name__}")
        if len(x.shape) != 3:
            raise ValueError(
                f"stage {self.stage} takes hidden states [B, L, H], got shape {list(x.shape)}"
            )
        if list(positions.shape) != list(x.shape[:2]):
            raise ValueError(
                f"positions {list(positions.shape)} must match the tokens {list(x.shape[:2])}"
            )
