"""A model's parameters by name and shape, and the matmul weights a token multiplies, read off
its families' building blocks (`Family.layer`) without building anything (no Paddle).

One source for every count: `flashcp.models.estimate_parameters` (the builder's CPU guard, the
run's start line, export shards) sums `stage_inventory`, the planner lists it
(`flashcp.plan.params`, which adds LoRA adapters), and the FLOPs per token (MFU, the planner's
step time, the data balancer's work model, `flashcp.cp.work`) use `matmul_weights`. The names and
shapes are the built model's, in its creation order (`flashcp.models.decoder`: Paddle's
`nn.Linear` weight is `[in, out]`); `tests/unit/plan/test_memory.py` checks them against real
models of every family, per pipeline stage.

The routed experts of an MoE layer are one sublayer ``model.layers.{i}.mlp.experts``
(`flashcp.models.experts.GroupedExperts`) with two stacked weights, ``gate_up_proj``
`[E, H, 2·Im]` and ``down_proj`` `[E, Im, H]`; under expert parallelism (`ep`) a rank holds
E/ep of them (same names, leading axis E/ep), the router and shared experts whole. The last
stage also holds the `model.mtp_layers` multi-token-prediction layers (`flashcp.models.mtp`):
layer ``model.layers.{L+d}`` is a decoder block of the family plus its own ``embed_tokens``,
``enorm``, ``hnorm``, ``eh_proj`` `[2H, H]` and ``shared_head`` (``norm``, ``head``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashcp.models.families.spec import DenseMLP, MoEMLP

if TYPE_CHECKING:
    from flashcp.models.config import ModelArgs


@dataclass(frozen=True)
class ParamSpec:
    """One parameter (or buffer) a stage holds."""

    name: str
    shape: tuple[int, ...]
    trained: bool = True
    linear: str | None = None
    """The sublayer LoRA can adapt (an `nn.Linear`, or the stacked routed experts) that this
    is the weight/bias of, if any (for LoRA matching)."""
    stacked: bool = False
    """A stacked routed-experts weight `[E, in, out]` (`GroupedExperts`)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


def _linear(prefix: str, din: int, dout: int, bias: bool) -> list[ParamSpec]:
    out = [ParamSpec(f"{prefix}.weight", (din, dout), linear=prefix)]
    if bias:
        out.append(ParamSpec(f"{prefix}.bias", (dout,), linear=prefix))
    return out


def _swiglu(prefix: str, h: int, inter: int, *, fused: bool, bias: bool) -> list[ParamSpec]:
    if fused:
        parts = _linear(f"{prefix}.gate_up_proj", h, 2 * inter, bias)
    else:
        parts = _linear(f"{prefix}.gate_proj", h, inter, bias)
        parts += _linear(f"{prefix}.up_proj", h, inter, bias)
    return parts + _linear(f"{prefix}.down_proj", inter, h, bias)


def _norm(prefix: str, h: int, kind: str) -> list[ParamSpec]:
    out = [ParamSpec(f"{prefix}.weight", (h,))]
    if kind == "layer":
        out.append(ParamSpec(f"{prefix}.bias", (h,)))
    return out


def held_experts(args: ModelArgs, ep: int = 1) -> int:
    """Routed experts per MoE layer on one rank under `parallel.ep` = `ep`."""
    if ep < 1 or args.num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide model.num_experts={args.num_experts}")
    return args.num_experts // ep


def layer_parameters(args: ModelArgs, index: int, ep: int = 1) -> list[ParamSpec]:
    """Decoder layer `index` (global), in the builder's creation order; `ep`: the
    expert-parallel degree (a rank holds E/ep routed experts)."""
    blocks = args.layer_blocks(index)
    h, hd, norm = args.hidden_size, args.head_size, blocks.norm
    p = f"model.layers.{index}"
    out = _norm(f"{p}.input_layernorm", h, norm)
    a, att = f"{p}.self_attn", blocks.attention
    out += _linear(f"{a}.q_proj", h, args.num_heads * hd, att.qkv_bias)
    out += _linear(f"{a}.k_proj", h, args.num_kv_heads * hd, att.qkv_bias)
    out += _linear(f"{a}.v_proj", h, args.num_kv_heads * hd, att.qkv_bias)
    out += _linear(f"{a}.o_proj", args.num_heads * hd, h, att.o_bias)
    if att.qk_norm:
        out += _norm(f"{a}.q_norm", hd, "rms") + _norm(f"{a}.k_norm", hd, "rms")
    out += _norm(f"{p}.post_attention_layernorm", h, norm)
    m, mlp = f"{p}.mlp", blocks.mlp
    if isinstance(mlp, MoEMLP):
        out.append(ParamSpec(f"{m}.gate.weight", (h, mlp.experts)))
        e, im = held_experts(args, ep), mlp.intermediate
        out += [
            ParamSpec(f"{m}.experts.gate_up_proj", (e, h, 2 * im), linear=f"{m}.experts",
                      stacked=True),
            ParamSpec(f"{m}.experts.down_proj", (e, im, h), linear=f"{m}.experts", stacked=True),
        ]  # fmt: skip
        if mlp.shared > 0:
            out += _swiglu(f"{m}.shared_experts", h, im * mlp.shared, fused=False, bias=False)
    elif mlp.kind == "gelu":
        out += _linear(f"{m}.fc_in", h, mlp.intermediate, True)
        out += _linear(f"{m}.fc_out", mlp.intermediate, h, True)
    else:
        out += _swiglu(m, h, mlp.intermediate, fused=mlp.fused, bias=mlp.bias)
    if blocks.sandwich_norms:
        out += _norm(f"{p}.post_self_attn_layernorm", h, norm)
        out += _norm(f"{p}.post_mlp_layernorm", h, norm)
    return out


def mtp_layer_parameters(args: ModelArgs, depth: int, ep: int = 1) -> list[ParamSpec]:
    """MTP layer `depth` (0-based, `flashcp.models.mtp`): the decoder block built at global
    index num_layers + depth, then its own parts (`add_mtp_parts`' order)."""
    h, norm = args.hidden_size, args.family.norm
    index = args.num_layers + depth
    p = f"model.layers.{index}"
    out = layer_parameters(args, index, ep)
    out.append(ParamSpec(f"{p}.embed_tokens.weight", (args.vocab_size, h)))
    out += _norm(f"{p}.enorm", h, norm)
    out += _norm(f"{p}.hnorm", h, norm)
    out += _linear(f"{p}.eh_proj", 2 * h, h, False)
    out += _norm(f"{p}.shared_head.norm", h, norm)
    out += _linear(f"{p}.shared_head.head", h, args.vocab_size, False)
    return out


def layer_buffers(args: ModelArgs, index: int) -> list[ParamSpec]:
    """Persistent buffers of layer `index`: a MoE router's selection bias (float32 `[E]`)."""
    moe = args.layer_blocks(index).moe
    if moe is None or not moe.router.correction_bias:
        return []
    name = f"model.layers.{index}.mlp.gate.e_score_correction_bias"
    return [ParamSpec(name, (args.num_experts,), trained=False)]


def stage_inventory(
    args: ModelArgs, layers: range | None = None, *, first: bool = True, last: bool = True,
    ep: int = 1,
) -> list[ParamSpec]:  # fmt: skip
    """Every parameter of decoder `layers` (GLOBAL indices; None: all), with the embeddings when
    `first` and the final norm, LM head (a tied embedding's own copy on a last stage that is
    not the first) and MTP layers when `last`."""
    h = args.hidden_size
    layers = range(args.num_layers) if layers is None else layers
    tied = args.tie_embeddings
    specs: list[ParamSpec] = []
    if first or (last and tied):
        specs.append(ParamSpec("model.embed_tokens.weight", (args.vocab_size, h)))
    if first and args.uses_learned_positions:
        specs.append(ParamSpec("model.embed_positions.weight", (args.max_seq_len, h)))
    for index in layers:
        specs += layer_parameters(args, index, ep)
    if last:
        specs += _norm("model.norm", h, args.family.norm)
        if not tied:
            specs += _linear("lm_head", h, args.vocab_size, False)
        for depth in range(args.mtp_layers):
            specs += mtp_layer_parameters(args, depth, ep)
    return specs


def parameter_count(
    args: ModelArgs, *, layers: range | None = None, first: bool = True, last: bool = True,
    ep: int = 1,
) -> int:  # fmt: skip
    """The number of parameters `stage_inventory` lists."""
    return sum(x.numel for x in stage_inventory(args, layers, first=first, last=last, ep=ep))


# ------------------------------------------------------------------------------------ FLOPs


def layer_matmul_weights(args: ModelArgs, layer: int) -> int:
    """The matmul weights one token multiplies in decoder layer `layer` (an MTP depth's block
    is layer num_layers + d): attention's projections, and the dense MLP or, for an MoE layer,
    the router, the shared experts and the `num_experts_per_tok` routed experts a token goes
    to (not all experts). Norms, biases and embedding lookups are not matmuls."""
    h, d = int(args.hidden_size), int(args.head_size)
    q, kv = int(args.num_heads) * d, int(args.num_kv_heads) * d
    attention = h * (q + 2 * kv) + q * h
    mlp = args.layer_blocks(layer).mlp
    if isinstance(mlp, MoEMLP):
        active = mlp.top_k + mlp.shared
        return attention + active * 3 * h * mlp.intermediate + h * mlp.experts
    assert isinstance(mlp, DenseMLP)
    return attention + (2 if mlp.kind == "gelu" else 3) * h * mlp.intermediate


def head_weights(args: ModelArgs) -> int:
    """The LM head's matmul weights (an MTP depth's shared head has as many)."""
    return int(args.vocab_size) * int(args.hidden_size)


def mtp_projection_weights(args: ModelArgs) -> int:
    """An MTP depth's eh_proj (2H × H)."""
    return 2 * int(args.hidden_size) ** 2


def trained_mtp_depths(args: ModelArgs) -> int:
    """The multi-token-prediction depths a step runs: `model.mtp_layers` when trained
    (`mtp_loss_weight` > 0), else 0 (frozen MTP layers are carried, never run)."""
    return int(args.mtp_layers) if args.mtp_trained else 0


def matmul_weights(args: ModelArgs) -> int:
    """N: the weights one token multiplies in matmuls — every decoder layer and the LM head;
    trained MTP depths add one more such layer, their eh_proj and their head each."""
    depths = trained_mtp_depths(args)
    layers = sum(layer_matmul_weights(args, i) for i in range(int(args.num_layers) + depths))
    return layers + head_weights(args) * (1 + depths) + depths * mtp_projection_weights(args)
