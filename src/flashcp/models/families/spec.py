"""What a model family declares, as data (no Paddle): its layers' building blocks, the values
its Hugging Face class always computes, its presets and its Hugging Face side.

A family is one `Family(...)` in one file of `flashcp.models.families`, registered there. Every
other part of flashcp asks the registry (`flashcp.models.families.family`) or the `ModelArgs`
of a model, never a family's name: the builder composes a decoder layer from `LayerBlocks`
(`flashcp.models.decoder`), the planner counts the same blocks' parameters and activations
(`flashcp.models.families.inventory`, `flashcp.plan.activations`), the FLOP counter their
matmul weights (`flashcp.models.families.inventory.layer_matmul_weights`), and the Hugging Face
loader and exporter read and write through `HFSide`.

The building blocks (`docs/models.md`, "Adding a model family"):

* a norm: RMSNorm (``rms``) or LayerNorm with bias (``layer``);
* attention: GQA with optional q/k/v bias, o bias and per-head QK-norm (RMSNorm over head_dim
  before rotary), rotary positions (half-split or interleaved pairs, partial, optionally
  Llama-3 scaled: `flashcp.models.rope`) or learned ones;
* a dense MLP: SwiGLU (separate or fused gate/up projections, optional biases) or GELU with
  biases;
* a MoE MLP: a `Router` (sigmoid or softmax scores, an optional selection-only correction
  bias, how the top-k weights are normalised, which auxiliary balance loss) over stacked
  routed experts, optional shared experts, on the layers `ModelArgs.is_moe_layer` names;
* optionally GLM-4's "sandwich" norms after attention and after the MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from flashcp.models.config import ModelArgs
    from flashcp.models.families.hf import HFSide

NormKind = Literal["rms", "layer"]
MLPKind = Literal["swiglu", "gelu"]
ErrFn = Callable[[str, str], None]


@dataclass(frozen=True)
class Router:
    """How a MoE layer routes a token (`flashcp.models.moe.TopkRouter`), in float32.

    `score`: the affinities, ``sigmoid`` (GLM-4.5, DeepSeek-V3) or ``softmax`` (Qwen3-MoE,
    ERNIE-4.5) of the router's logits. `correction_bias`: a selection-only float32 buffer
    ``e_score_correction_bias`` added to the scores to choose the top-k (the weights are the
    raw scores of the chosen experts); moved between steps by `model.router_bias_update_rate`.
    `normalise` the chosen weights: ``sum_eps`` divides by their sum + 1e-20 when
    `norm_topk_prob` (GLM-4.5), ``sum`` by their sum when `norm_topk_prob` (Qwen3-MoE),
    ``clamp`` always by max(sum, `moe_norm_min`) (ERNIE-4.5). `aux_loss`: what
    `model.router_aux_loss_coef` adds (`flashcp.models.moe_balance`): DeepSeek-V3's
    ``sequence``-wise balance loss, or the Switch/GShard ``switch`` load-balancing loss over
    the micro-batch that transformers' Qwen3-MoE and ERNIE-4.5 classes compute."""

    score: Literal["sigmoid", "softmax"]
    correction_bias: bool
    normalise: Literal["sum_eps", "sum", "clamp"]
    aux_loss: Literal["sequence", "switch"]


@dataclass(frozen=True)
class AttentionBlock:
    """Self-attention's options: biases of q/k/v and of o, per-head QK-norm."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


@dataclass(frozen=True)
class DenseMLP:
    """A dense MLP: SwiGLU (`fused`: one ``gate_up_proj``) or GELU (``fc_in``/``fc_out``,
    always biased); `bias`: SwiGLU's projections carry biases."""

    kind: MLPKind
    intermediate: int
    fused: bool = False
    bias: bool = False


@dataclass(frozen=True)
class MoEMLP:
    """Routed experts (each a bias-free SwiGLU of `intermediate`) chosen by `router`, `top_k`
    of `experts` per token, plus `shared` shared experts fused into one SwiGLU."""

    router: Router
    experts: int
    top_k: int
    intermediate: int
    shared: int


@dataclass(frozen=True)
class LayerBlocks:
    """What decoder layer i is made of (`Family.layer`)."""

    norm: NormKind
    attention: AttentionBlock
    mlp: DenseMLP | MoEMLP
    sandwich_norms: bool = False
    """GLM-4's ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` on the two branches."""

    @property
    def moe(self) -> MoEMLP | None:
        return self.mlp if isinstance(self.mlp, MoEMLP) else None


@dataclass(frozen=True)
class Preset:
    """A shipped shape: `args`, whether it is only built on a GPU, what it is."""

    args: ModelArgs
    gpu_only: bool
    note: str


BYTE_VOCAB = 260
"""256 byte values + a few specials: the byte tokenizer's vocabulary (tiny presets)."""
TINY: dict[str, Any] = dict(
    vocab_size=BYTE_VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    max_seq_len=256,
)  # fmt: skip
"""The widths every family's CPU-test preset (``tiny_<family>``) shares."""
SMALL: dict[str, Any] = dict(
    vocab_size=BYTE_VOCAB, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
    max_seq_len=1024,
)  # fmt: skip
"""The widths of the CPU-run presets (``small``...)."""
TINY_MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
    first_k_dense_replace=1,
)  # fmt: skip
"""The tiny MoE layers: 4 routed experts, top-2, one shared expert, the first layer dense."""


@dataclass(frozen=True)
class Family:
    """One model family: everything that makes it itself (module docstring).

    `arch` is the `ModelArgs.arch` value that selects it. The constant parts of its layers
    (`norm`, `mlp`, `fused_gate_up`, `sandwich_norms`, `router`, the default rotary pairing)
    are declared here; the widths and options a checkpoint sets are `ModelArgs` fields.
    `fixed` lists fields the family's reference class always computes at one value (anything
    else is refused, naming the value to set); `tied` groups fields one config key sets
    together (Llama's ``attention_bias`` biases q, k, v and o). `check` adds refusals no table
    expresses."""

    arch: str
    title: str
    norm: NormKind = "rms"
    mlp: MLPKind = "swiglu"
    fused_gate_up: bool = False
    sandwich_norms: bool = False
    router: Router | None = None
    rotary_interleaved: bool = False
    learned_positions: bool = False
    """`model.position: learned` is allowed (GPT); other families always rotate."""
    mtp: bool = False
    """Multi-token-prediction layers (`model.mtp_layers`, `flashcp.models.mtp`) are built."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    tied: tuple[tuple[str, ...], ...] = ()
    check: Callable[[ModelArgs, ErrFn], None] | None = None
    presets: Mapping[str, Preset] = field(default_factory=dict)
    hf: HFSide | None = None
    paddleformers_fused_adapters: bool = False
    """`flashcp export --adapters-for paddleformers` writes adapters for PaddleFormers' class
    of this family, whose q/k/v and gate/up projections are fused
    (`flashcp.checkpoint.fused_adapters`)."""

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def layer(self, args: ModelArgs, index: int) -> LayerBlocks:
        """The building blocks of decoder layer `index` (global; an MTP layer is
        num_layers + d) of a model of this family with `args`."""
        attention = AttentionBlock(
            qkv_bias=bool(args.qkv_bias), o_bias=bool(args.o_bias), qk_norm=bool(args.use_qk_norm)
        )
        mlp: DenseMLP | MoEMLP
        if self.router is not None and args.is_moe_layer(index):
            mlp = MoEMLP(
                self.router,
                args.num_experts,
                args.num_experts_per_tok,
                args.moe_intermediate_size,
                args.num_shared_experts,
            )
        elif self.mlp == "gelu":
            mlp = DenseMLP("gelu", args.intermediate_size, bias=True)
        else:
            mlp = DenseMLP(
                "swiglu", args.intermediate_size, fused=self.fused_gate_up, bias=bool(args.mlp_bias)
            )
        return LayerBlocks(self.norm, attention, mlp, self.sandwich_norms)

    def validate(self, args: ModelArgs, err: ErrFn) -> None:
        """The family's refusals of `args` (`fixed`, `tied`, `check`), as (field, message)."""
        for name, value in self.fixed.items():
            got = getattr(args, name)
            if got != value or type(got) is not type(value) and isinstance(value, bool):
                err(
                    name,
                    f"{name} {got!r}: arch {self.arch} ({self.title}) always computes "
                    f"{name}={value!r}; set model.{name}: {_yaml(value)}",
                )
        for group in self.tied:
            values = {name: getattr(args, name) for name in group}
            if len(set(values.values())) > 1:
                shown = ", ".join(f"{k}={v}" for k, v in values.items())
                err(
                    group[0],
                    f"{shown}: arch {self.arch} ({self.title}) sets {' and '.join(group)} "
                    f"together; set them all to {values[group[0]]}",
                )
        if self.check is not None:
            self.check(args, err)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
