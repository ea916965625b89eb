"""`ModelArgs`: the shape and options of one model, for every model family.

`arch` picks the family from the registry (`flashcp.models.families`: ``gpt``, ``glm``,
``glm_moe``, ``ernie4_5``, ``ernie4_5_moe``, ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``).
The family declares its layers' constant parts (norm, MLP kind, router, sandwich norms, the
default rotary pairing) and the values its reference class always computes; the fields here are
the widths and options a checkpoint sets: q/k/v and o biases, MLP biases, QK-norm, partial and
Llama-3-scaled rotary (`flashcp.models.rope`), tied embeddings, and for MoE families the
experts and which layers hold them (`is_moe_layer`: from `first_k_dense_replace` on, up to
`moe_layer_end`, every `moe_layer_interval`-th, except `mlp_only_layers`).

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

`problems()` returns every problem as a `flashcp.problems.Problem` (keys are
``model.<field>``) so the config layer can report them all at once; `check()` raises them,
all together, as one `ProblemsError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from flashcp.problems import Problem, ProblemsError

if TYPE_CHECKING:
    from flashcp.models.families.spec import Family, LayerBlocks

POSITIONS = ("rotary", "learned")
RECOMPUTE_MODES = ("none", "full", "refined")
RESIDUAL_DTYPES = ("float32", "bfloat16")
ROPE_SCALINGS = ("none", "llama3")

Arch = str  # a registered family (`flashcp.models.families.names()`)
Position = Literal["rotary", "learned"]
Recompute = Literal["none", "full", "refined"]
RopeScaling = Literal["none", "llama3"]
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
    position: Position = "rotary"  # "learned" only where the family allows it (GPT)
    rotary_base: float = 10000.0
    partial_rotary_factor: float = 1.0  # GLM uses 0.5: rotary on the first half of each head
    rotary_interleaved: bool | None = None  # None: the family's pairing (glm, ernie: True)
    rope_scaling: RopeScaling = "none"  # "llama3": Llama-3.1's frequency scaling (`rope`)
    rope_factor: float = 1.0  # llama3: the long-wavelength frequencies divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    rope_original_max_len: int = 0  # llama3: original_max_position_embeddings
    qkv_bias: bool = False
    o_bias: bool = False  # o_proj's bias (Llama / ERNIE-4.5 with attention_bias / use_bias)
    mlp_bias: bool = False  # the SwiGLU projections' biases (Llama mlp_bias, ERNIE use_bias)
    use_qk_norm: bool = False  # RMSNorm(head_dim) on each q and k head, pre-rotary
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    # MoE (families with a router)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0  # the first MoE layer (ERNIE's moe_layer_start_index)
    moe_layer_end: int = -1  # the last MoE layer; -1: no end (the MTP layers included)
    moe_layer_interval: int = 1  # layer i is MoE when (i + 1) % interval == 0 (Qwen's step)
    mlp_only_layers: tuple[int, ...] = ()  # dense layers among them (Qwen3-MoE)
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_norm_min: float = 1e-12  # "clamp" routers: weights / max(sum, moe_norm_min)
    moe_capacity_factor: float = 0.0  # 0: dropless; else rows per expert = ceil(f·T·k/E)
    router_bias_update_rate: float = 0.0  # γ of the aux-loss-free bias update; 0: off
    router_aux_loss_coef: float = 0.0  # α of the sequence-wise balance loss; 0: off
    # training
    recompute: Recompute = "none"
    residual_dtype: ResidualDtype = "float32"  # the stream between layers (see module doc)
    tile_tokens: int = 0  # > 0: token-wise layer parts run over tiles of this many positions a row
    initializer_range: float = 0.02
    # multi-token prediction (`flashcp.models.mtp`)
    mtp_layers: int = 0  # MTP depths after the last layer (GLM-4.5's num_nextn_predict_layers)
    mtp_loss_weight: float = 0.0  # λ of loss = main + λ·mean over depths; 0: carried frozen

    def __post_init__(self) -> None:
        # a YAML / JSON list of layers is the same as the tuple the dataclass keeps
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

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
    def family(self) -> Family:
        """The registered family of `arch` (`flashcp.models.families`); `ValueError` if none."""
        from flashcp.models.families import family

        return family(self.arch)

    @property
    def interleaved_rotary(self) -> bool:
        """Pairs (2i, 2i+1) rotate (GLM-4, ERNIE-4.5) or (i, i + rotary_dim/2) (the others):
        `rotary_interleaved`, or the family's pairing when unset."""
        if self.rotary_interleaved is not None:
            return bool(self.rotary_interleaved)
        return self.family.rotary_interleaved

    @property
    def uses_learned_positions(self) -> bool:
        return self.position == "learned" and self.family.learned_positions

    @property
    def is_moe(self) -> bool:
        """Whether the family routes tokens to experts (some layers may still be dense)."""
        return self.family.is_moe

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based; MTP layers are num_layers + d) uses routed
        experts: a MoE family's layers from `first_k_dense_replace` to `moe_layer_end` (-1: no
        end) whose (index + 1) is a multiple of `moe_layer_interval`, except `mlp_only_layers`
        (transformers' rules of GLM-4.5, ERNIE-4.5 and Qwen3-MoE in one)."""
        if not self.family.is_moe or layer < self.first_k_dense_replace:
            return False
        if 0 <= self.moe_layer_end < layer:
            return False
        interval = max(int(self.moe_layer_interval), 1)
        return (layer + 1) % interval == 0 and layer not in self.mlp_only_layers

    def layer_blocks(self, layer: int) -> LayerBlocks:
        """The building blocks of decoder layer `layer` (`flashcp.models.families.spec`)."""
        return self.family.layer(self, layer)

    def matmul_weights(self) -> int:
        """The weights one token multiplies in matmuls (the FLOPs' N,
        `flashcp.models.families.inventory.matmul_weights`)."""
        from flashcp.models.families.inventory import matmul_weights

        return matmul_weights(self)

    # ------------------------------------------------------------------ validation

    def problems(self) -> list[Problem]:
        """Every problem, keyed `model.<field>`; empty when the args build a model."""
        errs: list[Problem] = []

        def err(name: str, message: str) -> None:
            errs.append(Problem(f"model.{name}", message))

        from flashcp.models.families import FAMILIES

        fam = FAMILIES.get(self.arch) if isinstance(self.arch, str) else None
        if fam is None:
            err("arch", f"arch {self.arch!r} is not supported: use one of {', '.join(FAMILIES)}")
            return errs  # every other rule depends on the family
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
        elif self.position != "rotary" and not fam.learned_positions:
            err("position", f"arch {self.arch} always uses rotary positions; set position: rotary")
        self._validate_rotary(err)
        fam.validate(self, err)
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

    def _validate_scaling(self, err: ErrFn) -> None:
        """`rope_scaling` and its numbers (transformers' `_validate_llama3_parameters`)."""
        if self.rope_scaling not in ROPE_SCALINGS:
            err(
                "rope_scaling",
                f"rope_scaling {self.rope_scaling!r}: use one of {', '.join(ROPE_SCALINGS)}",
            )
            return
        if self.rope_scaling == "none":
            return
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                err(name, f"{name} {value!r} must be a number > 0 (rope_scaling llama3)")
        if _is_int(self.rope_original_max_len) and self.rope_original_max_len > 0:
            pass
        else:
            err(
                "rope_original_max_len",
                f"rope_original_max_len {self.rope_original_max_len!r} must be a positive "
                "integer (config.json rope_scaling.original_max_position_embeddings)",
            )
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        if _number(low) and _number(high) and not high > low:
            err(
                "rope_high_freq_factor",
                f"rope_high_freq_factor {high} must exceed rope_low_freq_factor {low} "
                "(llama3 scaling interpolates between them)",
            )

    def _validate_mtp(self, err: ErrFn) -> None:
        """`mtp_layers` >= 0 on rotary models; `mtp_loss_weight` >= 0, > 0 only with layers."""
        n, weight = self.mtp_layers, self.mtp_loss_weight
        if not _is_int(n) or n < 0:
            err("mtp_layers", f"mtp_layers {n!r} must be an integer >= 0 (0 = no MTP layer)")
            return
        if n and not self.family.mtp:
            err(
                "mtp_layers",
                f"mtp_layers {n}: arch {self.arch} has no multi-token-prediction layers flashcp "
                "builds (GLM-4 and GLM-4.5 do); set model.mtp_layers: 0",
            )
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
        if tile == 0 or not self.is_moe:
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
        self._validate_scaling(err)
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
        router = self.family.router
        if router is None:
            for name in (*moe_fields, "num_shared_experts", "first_k_dense_replace", *options):
                if getattr(self, name):
                    err(
                        name,
                        f"{name} is only used by MoE families (arch {self.arch} has no experts); "
                        "set 0",
                    )
            for name, default in _MOE_PATTERN.items():
                if getattr(self, name) != default:
                    err(
                        name,
                        f"{name} only places MoE layers (arch {self.arch} has no experts); set "
                        f"model.{name}: {default!r}",
                    )
            return
        self._validate_moe_pattern(err)
        if router.normalise != "clamp" and self.moe_norm_min != _MOE_NORM_MIN:
            err(
                "moe_norm_min",
                f"moe_norm_min {self.moe_norm_min!r}: arch {self.arch}'s router does not clamp "
                f"the top-k weights' sum (ERNIE-4.5's does); set model.moe_norm_min: "
                f"{_MOE_NORM_MIN}",
            )
        elif router.normalise == "clamp" and not (_number(self.moe_norm_min)
                                                   and self.moe_norm_min > 0):  # fmt: skip
            err("moe_norm_min", f"moe_norm_min {self.moe_norm_min!r} must be a number > 0")
        if self.router_bias_update_rate and not router.correction_bias:
            err(
                "router_bias_update_rate",
                f"router_bias_update_rate {self.router_bias_update_rate} moves the router's "
                f"selection bias, but arch {self.arch}'s router has none; set "
                "model.router_bias_update_rate: 0 (model.router_aux_loss_coef balances it)",
            )
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

    def _validate_moe_pattern(self, err: ErrFn) -> None:
        """`moe_layer_end` >= -1, `moe_layer_interval` >= 1, `mlp_only_layers` layer indices."""
        if not _is_int(self.moe_layer_end) or self.moe_layer_end < -1:
            err("moe_layer_end", f"moe_layer_end {self.moe_layer_end!r} must be -1 or a layer")
        if not _is_pos_int(self.moe_layer_interval):
            err(
                "moe_layer_interval",
                f"moe_layer_interval {self.moe_layer_interval!r} must be a positive integer",
            )
        only = self.mlp_only_layers
        if not isinstance(only, tuple) or not all(_is_int(i) and i >= 0 for i in only):
            err("mlp_only_layers", f"mlp_only_layers {only!r} must be a list of layer indices")

    def check(self) -> ModelArgs:
        """Raise `ProblemsError` (a `ValueError`) with every problem; return self when valid."""
        if errs := self.problems():
            raise ProblemsError(errs, "the model arguments")
        return self

    def to_dict(self) -> dict[str, object]:
        """Field name → value (for logs, checkpoints and `config.json`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_MOE_PATTERN: dict[str, object] = {"moe_layer_end": -1, "moe_layer_interval": 1,
                                   "mlp_only_layers": ()}  # fmt: skip
_MOE_NORM_MIN = 1e-12


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
    with 1/ep_size of the routed experts. The sum of the family's parameter inventory
    (`flashcp.models.families.inventory`), the planner's one source."""
    from flashcp.models.families.inventory import parameter_count

    return parameter_count(args, layers=layers, first=first, last=last, ep=ep_size)
