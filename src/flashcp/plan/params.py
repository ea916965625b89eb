"""The parameter inventory of one pipeline stage, by name and shape, without building anything.

`stage_parameters(args, stage, pp, ...)` lists what a stage holds exactly as the models build
it (`flashcp.models.gpt` / `glm` / `moe`, `flashcp.pipeline.stage`): the token (and learned
position) embeddings on the first stage, decoder layers by GLOBAL index, the final norm and the
LM head (or, with tied embeddings under pp > 1, the last stage's copy of the embedding) on the
last. Paddle's `nn.Linear` weight is `[in, out]`. The routed experts of an MoE layer are one
sublayer ``model.layers.{i}.mlp.experts`` (`flashcp.models.experts.GroupedExperts`) with two
stacked weights, ``gate_up_proj`` `[E, H, 2·Im]` and ``down_proj`` `[E, Im, H]`; under expert
parallelism (`parallel.ep`) a rank holds only its ep rank's E/ep of them (same names, leading
axis E/ep: `flashcp.models.expert_parallel`), the router and shared experts whole.

With LoRA targets (regexes matched with `re.fullmatch` against the sublayer names,
PaddleFormers' rule) every matched linear gains `lora_A [in, r]` and `lora_B [r, out]`, and a
matched experts layer gains per-expert adapters on both stacked weights
(`flashcp.lora.experts`: ``{w}_lora_A [E, in, r]``, ``{w}_lora_B [E, r, out]``); the
adapters are the only trained parameters, everything else is frozen. Buffers (the MoE
router's `e_score_correction_bias`, float32) are listed apart.

The last stage also holds the `model.mtp_layers` multi-token-prediction layers
(`flashcp.models.mtp`): layer ``model.layers.{L+d}`` is a decoder block of the family plus its
own ``embed_tokens`` `[V, H]`, ``enorm``, ``hnorm``, ``eh_proj`` `[2H, H]` and
``shared_head`` (``norm``, ``head`` `[H, V]`). With `model.mtp_loss_weight` 0 they are carried
frozen (`flashcp.models.mtp.freeze_mtp_layers`, after LoRA: their adapters frozen too).

The unit tests check names and shapes against real models, so the byte counts of the planner
rest on an exact inventory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from flashcp.models.config import ModelArgs
from flashcp.pipeline.split import split_layers


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


def _swiglu(prefix: str, h: int, inter: int, *, fused: bool) -> list[ParamSpec]:
    if fused:
        parts = _linear(f"{prefix}.gate_up_proj", h, 2 * inter, False)
    else:
        parts = _linear(f"{prefix}.gate_proj", h, inter, False)
        parts += _linear(f"{prefix}.up_proj", h, inter, False)
    return parts + _linear(f"{prefix}.down_proj", inter, h, False)


def _experts(prefix: str, e: int, h: int, inter: int) -> list[ParamSpec]:
    """`GroupedExperts`: the stacked gate/up and down projections of the E routed experts."""
    return [
        ParamSpec(f"{prefix}.gate_up_proj", (e, h, 2 * inter), linear=prefix, stacked=True),
        ParamSpec(f"{prefix}.down_proj", (e, inter, h), linear=prefix, stacked=True),
    ]


def _norm(prefix: str, h: int, *, layer_norm: bool) -> list[ParamSpec]:
    out = [ParamSpec(f"{prefix}.weight", (h,))]
    if layer_norm:
        out.append(ParamSpec(f"{prefix}.bias", (h,)))
    return out


def held_experts(args: ModelArgs, ep: int = 1) -> int:
    """Routed experts per MoE layer on one rank under `parallel.ep` = `ep`."""
    if ep < 1 or args.num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide model.num_experts={args.num_experts}")
    return args.num_experts // ep


def is_expert(spec: ParamSpec) -> bool:
    """A routed-experts tensor (stacked weight or its adapter): split by expert parallelism,
    its gradients reduced and its optimizer state sharded over the edp group."""
    return ".mlp.experts." in spec.name


def layer_parameters(args: ModelArgs, index: int, ep: int = 1) -> list[ParamSpec]:
    """Decoder layer `index` (global), in the models' creation order; `ep`: the expert-parallel
    degree (a rank holds E/ep routed experts)."""
    h, hd = args.hidden_size, args.head_size
    p = f"model.layers.{index}"
    gpt = args.arch == "gpt"
    out = _norm(f"{p}.input_layernorm", h, layer_norm=gpt)
    a = f"{p}.self_attn"
    out += _linear(f"{a}.q_proj", h, args.num_heads * hd, args.qkv_bias)
    out += _linear(f"{a}.k_proj", h, args.num_kv_heads * hd, args.qkv_bias)
    out += _linear(f"{a}.v_proj", h, args.num_kv_heads * hd, args.qkv_bias)
    out += _linear(f"{a}.o_proj", args.num_heads * hd, h, False)
    out += _norm(f"{p}.post_attention_layernorm", h, layer_norm=gpt)
    m = f"{p}.mlp"
    if gpt:
        out += _linear(f"{m}.fc_in", h, args.intermediate_size, True)
        out += _linear(f"{m}.fc_out", args.intermediate_size, h, True)
    elif args.is_moe_layer(index):
        out.append(ParamSpec(f"{m}.gate.weight", (h, args.num_experts)))
        out += _experts(f"{m}.experts", held_experts(args, ep), h, args.moe_intermediate_size)
        if args.num_shared_experts > 0:
            inter = args.moe_intermediate_size * args.num_shared_experts
            out += _swiglu(f"{m}.shared_experts", h, inter, fused=False)
    else:
        out += _swiglu(m, h, args.intermediate_size, fused=args.arch == "glm")
    if args.arch == "glm":
        out += _norm(f"{p}.post_self_attn_layernorm", h, layer_norm=False)
        out += _norm(f"{p}.post_mlp_layernorm", h, layer_norm=False)
    return out


def mtp_layer_parameters(args: ModelArgs, depth: int, ep: int = 1) -> list[ParamSpec]:
    """MTP layer `depth` (0-based, `flashcp.models.mtp`): the decoder block built at global
    index num_layers + depth, then its own parts (`add_mtp_parts`' order)."""
    h = args.hidden_size
    index = args.num_layers + depth
    p = f"model.layers.{index}"
    gpt = args.arch == "gpt"
    out = layer_parameters(args, index, ep)
    out.append(ParamSpec(f"{p}.embed_tokens.weight", (args.vocab_size, h)))
    out += _norm(f"{p}.enorm", h, layer_norm=gpt)
    out += _norm(f"{p}.hnorm", h, layer_norm=gpt)
    out += _linear(f"{p}.eh_proj", 2 * h, h, False)
    out += _norm(f"{p}.shared_head.norm", h, layer_norm=gpt)
    out += _linear(f"{p}.shared_head.head", h, args.vocab_size, False)
    return out


def is_mtp(spec: ParamSpec, args: ModelArgs) -> bool:
    """Whether `spec` belongs to an MTP layer (`model.layers.{i}` with i >= num_layers)."""
    m = re.match(r"model\.layers\.(\d+)\.", spec.name)
    return m is not None and int(m.group(1)) >= args.num_layers


def layer_buffers(args: ModelArgs, index: int) -> list[ParamSpec]:
    """Persistent buffers of layer `index`: the MoE router's selection bias (float32 `[E]`)."""
    if not args.is_moe_layer(index):
        return []
    name = f"model.layers.{index}.mlp.gate.e_score_correction_bias"
    return [ParamSpec(name, (args.num_experts,), trained=False)]


def stage_layers(args: ModelArgs, stage: int, pp: int, pp_layers: Sequence[int] | None) -> range:
    """The global decoder-layer indices stage `stage` of `pp` runs (`parallel.pp_layers`)."""
    return split_layers(args.num_layers, pp, pp_layers)[stage]


def is_adapted(spec: ParamSpec, patterns: Sequence[re.Pattern[str]]) -> bool:
    """Whether LoRA adapts the weight `spec` (a linear's weight or a stacked experts weight
    whose sublayer matches one of `patterns`)."""
    lin = spec.linear
    weight = spec.stacked or spec.name.endswith(".weight")
    return bool(lin) and weight and any(p.fullmatch(lin) for p in patterns)


def _apply_lora(specs: list[ParamSpec], targets: Sequence[str], rank: int) -> list[ParamSpec]:
    patterns = [re.compile(t) for t in targets]
    out: list[ParamSpec] = []
    for spec in specs:
        out.append(
            ParamSpec(
                spec.name, spec.shape, trained=False, linear=spec.linear, stacked=spec.stacked
            )
        )
        if not is_adapted(spec, patterns):
            continue
        lin = spec.linear
        if spec.stacked:  # PaddleFormers' LoRAMoeExperts: per-expert A, B after each weight
            e, din, dout = spec.shape
            out.append(ParamSpec(f"{spec.name}_lora_A", (e, din, rank), linear=lin))
            out.append(ParamSpec(f"{spec.name}_lora_B", (e, rank, dout), linear=lin))
        else:
            din, dout = spec.shape
            out.append(ParamSpec(f"{lin}.lora_A", (din, rank), linear=lin))
            out.append(ParamSpec(f"{lin}.lora_B", (rank, dout), linear=lin))
    return out


def stage_parameters(
    args: ModelArgs,
    stage: int = 0,
    pp: int = 1,
    pp_layers: Sequence[int] | None = None,
    *,
    lora_targets: Sequence[str] | None = None,
    lora_rank: int = 8,
    ep: int = 1,
) -> list[ParamSpec]:
    """Every parameter stage `stage` of `pp` holds (pp = 1: the whole model); under expert
    parallelism `ep` only E/ep routed experts per MoE layer (every ep rank holds as many).

    With `lora_targets`, base weights are frozen and the adapters (`lora_A`, `lora_B`) are
    the trained parameters, listed after the weight they adapt (PaddleFormers' `LoRALinear`).
    """
    h = args.hidden_size
    first, last = stage == 0, stage == pp - 1
    specs: list[ParamSpec] = []
    tied = args.tie_embeddings
    if first or (last and tied and pp > 1):
        specs.append(ParamSpec("model.embed_tokens.weight", (args.vocab_size, h)))
    if first and args.uses_learned_positions:
        specs.append(ParamSpec("model.embed_positions.weight", (args.max_seq_len, h)))
    for index in stage_layers(args, stage, pp, pp_layers):
        specs += layer_parameters(args, index, ep)
    if last:
        specs += _norm("model.norm", h, layer_norm=args.arch == "gpt")
        if not tied:
            specs += _linear("lm_head", h, args.vocab_size, False)
        for depth in range(args.mtp_layers):
            specs += mtp_layer_parameters(args, depth, ep)
    if lora_targets:
        specs = _apply_lora(specs, lora_targets, lora_rank)
    if not args.mtp_trained:  # carried frozen, adapters included (`freeze_mtp_layers`)
        specs = [
            ParamSpec(x.name, x.shape, trained=False, linear=x.linear, stacked=x.stacked)
            if is_mtp(x, args) else x
            for x in specs
        ]  # fmt: skip
    return specs


def stage_buffers(
    args: ModelArgs, stage: int = 0, pp: int = 1, pp_layers: Sequence[int] | None = None
) -> list[ParamSpec]:
    """The persistent buffers of the stage's layers (the last stage's MTP layers included)."""
    out: list[ParamSpec] = []
    for index in stage_layers(args, stage, pp, pp_layers):
        out += layer_buffers(args, index)
    if stage == pp - 1:
        for depth in range(args.mtp_layers):
            out += layer_buffers(args, args.num_layers + depth)
    return out
