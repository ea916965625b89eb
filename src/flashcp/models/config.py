"""`ModelArgs`: the shape and options of one model, for all three architectures.

`arch` picks the family:

* ``gpt``: pre-LN decoder with LayerNorm, rotary or learned positions, GELU MLP.
* ``glm``: GLM-4 dense (HF ``Glm4ForCausalLM``): RMSNorm, partial *interleaved* rotary,
  QKV bias, GQA, SwiGLU with a fused ``gate_up_proj``, and GLM-4's two extra norms
  (``post_self_attn_layernorm``, ``post_mlp_layernorm``).
* ``glm_moe``: GLM-4.5 (HF ``Glm4MoeForCausalLM``): RMSNorm, partial *half-split* (NeoX)
  rotary, QKV bias, GQA, sigmoid top-k routed experts with a selection-only correction bias,
  shared experts, the first ``first_k_dense_replace`` layers dense; optionally QK-norm
  (`use_qk_norm`: RMSNorm over each head of q and k before rotary, as the full GLM-4.5).

Training options: `recompute` (``none``; ``full``: each decoder layer keeps only its input
and reruns in backward; ``refined``: also keeps the attention output and LSE, so attention
runs forward once) and `residual_dtype`, the dtype of the residual stream BETWEEN layers:
the embedding output, each layer's output (= the next layer's input, what ``full`` recompute
keeps and `train.offload_activations` moves) and what pipeline stages send. ``float32`` (the
default) keeps today's numbers. ``bfloat16`` rounds the stream once per layer boundary (each
layer upcasts its input and computes its norms and residual adds in float32 as before, the
final norm too), halving the kept inputs, the offloaded bytes and the stage transfers;
gradients are rounded at the same boundaries. Megatron-LM keeps a bf16 residual by default
(``--fp32-residual-connection`` is its opt-in). Use ``bfloat16`` for long-context GPU runs,
where the kept layer inputs (layers × local tokens × hidden) are a dominant item of the memory
plan; keep ``float32`` for CPU runs compared against float32 references (the golden losses)
and wherever the per-layer rounding is not wanted. On CPU a bf16 stream is stored and cast
only (no bf16 matmul there), with the same rounding as on a GPU.

`validate()` returns every problem as ``(key, message)`` pairs (keys are ``model.<field>``)
so the config layer can report them all at once; `check()` raises on the first batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

ARCHS = ("gpt", "glm", "glm_moe")
POSITIONS = ("rotary", "learned")
RECOMPUTE_MODES = ("none", "full", "refined")
RESIDUAL_DTYPES = ("float32", "bfloat16")

Arch = Literal["gpt", "glm", "glm_moe"]
Position = Literal["rotary", "learned"]
Recompute = Literal["none", "full", "refined"]
ResidualDtype = Literal["float32", "bfloat16"]
ErrFn = Callable[[str, str], None]  # (field name, message)


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Everything needed to build a model; frozen so a run's shape cannot drift."""

    arch: Arch = "gpt"
    vocab_size: int = 260
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 256
    max_seq_len: int = 256
    position: Position = "rotary"  # GPT only; GLM is always rotary
    rotary_base: float = 10000.0
    partial_rotary_factor: float = 1.0  # GLM uses 0.5: rotary on the first half of each head
    rotary_interleaved: bool | None = None  # None: per arch (glm True, gpt/glm_moe False)
    qkv_bias: bool = False
    use_qk_norm: bool = False  # glm_moe only: RMSNorm(head_dim) on each q and k head, pre-rotary
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    # MoE (glm_moe only)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_capacity_factor: float = 0.0  # 0: dropless; else rows per expert = ceil(f·T·k/E)
    router_bias_update_rate: float = 0.0  # γ of the aux-loss-free bias update; 0: off
    router_aux_loss_coef: float = 0.0  # α of the sequence-wise balance loss; 0: off
    # training
    recompute: Recompute = "none"
    residual_dtype: ResidualDtype = "float32"  # the stream between layers (see module doc)
    tile_tokens: int = 0  # > 0: token-wise layer parts run over tiles of this many local tokens
    initializer_range: float = 0.02
    # multi-token prediction (`flashcp.models.mtp`)
    mtp_layers: int = 0  # MTP depths after the last layer (GLM-4.5's num_nextn_predict_layers)
    mtp_loss_weight: float = 0.0  # λ of loss = main + λ·mean over depths; 0: carried frozen

    # ------------------------------------------------------------------ derived values

    @property
    def head_size(self) -> int:
        """The per-head dimension: `head_dim`, or `hidden_size // num_heads` when unset."""
        if self.head_dim is not None:
            return int(self.head_dim)
        return self.hidden_size // max(self.num_heads, 1)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head are rotated (0 for learned positions)."""
        if self.uses_learned_positions:
            return 0
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def interleaved_rotary(self) -> bool:
        """GLM-4 rotates pairs (2i, 2i+1); GLM-4.5 and GPT rotate (i, i + rotary_dim/2)."""
        if self.rotary_interleaved is not None:
            return bool(self.rotary_interleaved)
        return self.arch == "glm"

    @property
    def uses_learned_positions(self) -> bool:
        return self.arch == "gpt" and self.position == "learned"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) uses routed experts."""
        return self.arch == "glm_moe" and layer >= self.first_k_dense_replace

    # ------------------------------------------------------------------ validation

    def validate(self) -> list[tuple[str, str]]:
        """All problems as `(key, message)` pairs; empty when the args build a model."""
        errs: list[tuple[str, str]] = []

        def err(name: str, message: str) -> None:
            errs.append((f"model.{name}", message))

        if self.arch not in ARCHS:
            err("arch", f"arch {self.arch!r} is not supported: use one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            _positive_int(err, name, getattr(self, name))
        _positive_int(err, "intermediate_size", self.intermediate_size)
        _positive_int(err, "max_seq_len", self.max_seq_len)
        if self.head_dim is not None:
            _positive_int(err, "head_dim", self.head_dim)
        elif _all_pos(self.hidden_size, self.num_heads) and self.hidden_size % self.num_heads:
            err(
                "head_dim",
                f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                f"{self.num_heads}: set model.head_dim explicitly or change num_heads",
            )
        if _all_pos(self.num_heads, self.num_kv_heads) and self.num_heads % self.num_kv_heads:
            err(
                "num_heads",
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}: grouped-query attention shares each KV head among "
                "num_heads / num_kv_heads query heads",
            )
        if self.position not in POSITIONS:
            err("position", f"position {self.position!r}: use one of {', '.join(POSITIONS)}")
        elif self.arch in ("glm", "glm_moe") and self.position != "rotary":
            err("position", f"arch {self.arch} always uses rotary positions; set position: rotary")
        self._validate_rotary(err)
        if self.use_qk_norm and self.arch != "glm_moe":
            err(
                "use_qk_norm",
                f"use_qk_norm is GLM-4.5's QK-norm (arch glm_moe); arch {self.arch} has none: "
                "set use_qk_norm: false",
            )
        if not self.norm_eps > 0:
            err("norm_eps", f"norm_eps {self.norm_eps} must be > 0")
        if not self.initializer_range > 0:
            err("initializer_range", f"initializer_range {self.initializer_range} must be > 0")
        if self.recompute not in RECOMPUTE_MODES:
            err(
                "recompute",
                f"recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}",
            )
        if self.residual_dtype not in RESIDUAL_DTYPES:
            err(
                "residual_dtype",
                f"residual_dtype {self.residual_dtype!r}: use one of {', '.join(RESIDUAL_DTYPES)}",
            )
        self._validate_moe(err)
        self._validate_tiling(err)
        self._validate_mtp(err)
        return errs

    def _validate_mtp(self, err: ErrFn) -> None:
        """`mtp_layers` >= 0 on rotary models; `mtp_loss_weight` >= 0, > 0 only with layers."""
        n, weight = self.mtp_layers, self.mtp_loss_weight
        if not _is_int(n) or n < 0:
            err("mtp_layers", f"mtp_layers {n!r} must be an integer >= 0 (0 = no MTP layer)")
            return
        if n and self.uses_learned_positions:
            err(
                "mtp_layers",
                f"mtp_layers {n}: the multi-token-prediction layers take rotary positions; "
                "set model.position: rotary or model.mtp_layers: 0",
            )
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            err("mtp_loss_weight", f"mtp_loss_weight {weight!r} must be a number >= 0")
        elif not math.isfinite(weight) or weight < 0:
            err("mtp_loss_weight", f"mtp_loss_weight {weight} must be a finite number >= 0")
        elif weight > 0 and n == 0:
            err(
                "mtp_loss_weight",
                f"mtp_loss_weight {weight} trains multi-token-prediction layers, but "
                "model.mtp_layers is 0: set model.mtp_layers (GLM-4.5 has 1) or "
                "mtp_loss_weight: 0",
            )

    @property
    def mtp_trained(self) -> bool:
        """Whether the MTP layers are trained (`mtp_loss_weight` > 0), not carried frozen."""
        return self.mtp_layers > 0 and self.mtp_loss_weight > 0

    def _validate_tiling(self, err: ErrFn) -> None:
        """`tile_tokens` (`flashcp.models.tiling`): an integer >= 0, and no MoE option that
        needs the whole sequence at once inside one call."""
        tile = self.tile_tokens
        if not _is_int(tile) or tile < 0:
            err("tile_tokens", f"tile_tokens {tile!r} must be an integer >= 0 (0 = no tiling)")
            return
        if tile == 0 or self.arch != "glm_moe":
            return
        if self.moe_capacity_factor:
            err(
                "tile_tokens",
                f"tile_tokens {tile} runs the MoE layers over tiles of {tile} tokens, but "
                f"moe_capacity_factor {self.moe_capacity_factor} caps each expert at "
                "ceil(f·T·k/E) rows of the whole call's T tokens, which would become a "
                "per-tile cap (different drops): set model.moe_capacity_factor: 0 (dropless) "
                "or model.tile_tokens: 0",
            )
        if self.router_aux_loss_coef:
            err(
                "tile_tokens",
                f"tile_tokens {tile} runs the MoE router over tiles, but the sequence-wise "
                f"balance loss (router_aux_loss_coef {self.router_aux_loss_coef}) multiplies "
                "per-expert means over the whole sequence, which no tile sees: set "
                "model.router_aux_loss_coef: 0 (the aux-loss-free router_bias_update_rate "
                "works with tiling) or model.tile_tokens: 0",
            )

    def _validate_rotary(self, err: ErrFn) -> None:
        if self.uses_learned_positions:
            return
        if not self.rotary_base > 0:
            err("rotary_base", f"rotary_base {self.rotary_base} must be > 0")
        if not 0 < self.partial_rotary_factor <= 1:
            err(
                "partial_rotary_factor",
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1]",
            )
            return
        hd = self.head_size
        if hd > 0 and (self.rotary_dim < 2 or self.rotary_dim % 2):
            err(
                "partial_rotary_factor",
                f"rotary dim = head_dim {hd} × partial_rotary_factor "
                f"{self.partial_rotary_factor} = {self.rotary_dim} must be a positive even "
                "number (rotary turns pairs of dims)",
            )

    def _validate_moe(self, err: ErrFn) -> None:
        moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        options = ("moe_capacity_factor", "router_bias_update_rate", "router_aux_loss_coef")
        if self.arch != "glm_moe":
            for name in (*moe_fields, "num_shared_experts", "first_k_dense_replace", *options):
                if getattr(self, name):
                    err(name, f"{name} is only used by arch glm_moe (arch is {self.arch}); set 0")
            return
        for name in options:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                err(name, f"{name} {value!r} must be a finite number >= 0 (0 turns it off)")
        for name in moe_fields:
            _positive_int(err, name, getattr(self, name))
        k_over = _all_pos(self.num_experts, self.num_experts_per_tok) and (
            self.num_experts_per_tok > self.num_experts
        )
        if k_over:
            err(
                "num_experts_per_tok",
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts "
                f"{self.num_experts}",
            )
        if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
            err("num_shared_experts", f"num_shared_experts {self.num_shared_experts} must be >= 0")
        k = self.first_k_dense_replace
        if not _is_int(k) or k < 0 or (_is_int(self.num_layers) and k > self.num_layers):
            err(
                "first_k_dense_replace",
                f"first_k_dense_replace {k} must be in [0, num_layers={self.num_layers}]",
            )
        if not self.routed_scaling_factor > 0:
            err(
                "routed_scaling_factor",
                f"routed_scaling_factor {self.routed_scaling_factor} must be > 0",
            )

    def check(self) -> ModelArgs:
        """Raise `ValueError` listing every problem; return self when valid."""
        errs = self.validate()
        if errs:
            lines = "\n".join(f"  {key}: {msg}" for key, msg in errs)
            raise ValueError(f"invalid model arguments:\n{lines}")
        return self

    def to_dict(self) -> dict[str, object]:
        """Field name → value (for logs, checkpoints and `config.json`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_pos_int(x: object) -> bool:
    return _is_int(x) and x > 0  # type: ignore[operator]


def _all_pos(*xs: object) -> bool:
    return all(_is_pos_int(x) for x in xs)


def _positive_int(err: ErrFn, name: str, value: object) -> None:
    if not _is_pos_int(value):
        err(name, f"{name} {value!r} must be a positive integer")


def estimate_parameters(
    args: ModelArgs,
    *,
    layers: range | None = None,
    first: bool = True,
    last: bool = True,
    ep_size: int = 1,
) -> int:
    """Parameter count of the model `args` builds (buffers excluded), without building it; or
    of one pipeline stage: decoder `layers` (GLOBAL indices), the embeddings when `first`, the
    final norm and LM head when `last` (its own copy of a tied embedding when not `first`, and
    the `mtp_layers` multi-token-prediction layers); under expert parallelism (`ep_size` > 1)
    with 1/ep_size of the routed experts."""
    h, hd = args.hidden_size, args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if args.qkv_bias else 0)
    attn += 2 * hd if args.use_qk_norm else 0
    if args.arch == "gpt":
        norms, dense_mlp = 2 * 2 * h, 2 * h * args.intermediate_size + args.intermediate_size + h
    else:
        norms = (4 if args.arch == "glm" else 2) * h
        dense_mlp = 3 * h * args.intermediate_size
    moe_mlp = 0
    if args.arch == "glm_moe":
        expert = 3 * h * args.moe_intermediate_size
        held = args.num_experts // max(ep_size, 1)
        moe_mlp = held * expert + args.num_experts * h + args.num_shared_experts * expert
    total = 0
    for layer in range(args.num_layers) if layers is None else layers:
        total += attn + norms + (moe_mlp if args.is_moe_layer(layer) else dense_mlp)
    embed = args.vocab_size * h
    if first:
        total += embed + (args.max_seq_len * h if args.uses_learned_positions else 0)
    if last:
        norm = 2 * h if args.arch == "gpt" else h
        total += norm
        if not args.tie_embeddings or not first:
            total += embed
        for depth in range(args.mtp_layers):  # the MTP layers: a block and its own parts
            layer = args.num_layers + depth
            block = attn + norms + (moe_mlp if args.is_moe_layer(layer) else dense_mlp)
            total += block + 2 * embed + 3 * norm + 2 * h * h
    return total
