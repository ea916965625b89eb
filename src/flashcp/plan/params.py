"""The parameter inventory of one pipeline stage, by name and shape, without building anything.

`stage_parameters(args, stage, pp, ...)` lists what a stage holds exactly as the models build it —
the family's inventory (`flashcp.models.families.inventory`, read off its building blocks) for the
stage's layers (`flashcp.pipeline.stage`), plus LoRA adapters: the token (and learned position)
embeddings on the first stage, decoder layers by GLOBAL index, the final norm and the LM head (or,
with tied embeddings under pp > 1, the last stage's copy of the embedding) on the last. Paddle's
`nn.Linear` weight is `[in, out]`. The routed experts of an MoE layer are one sublayer
``model.layers.{i}.mlp.experts`` (`flashcp.models.experts.GroupedExperts`) with two stacked weights,
``gate_up_proj`` `[E, H, 2·Im]` and ``down_proj`` `[E, Im, H]`; under expert parallelism
(`parallel.ep`) a rank holds only its ep rank's E/ep of them (same names, leading axis E/ep:
`flashcp.models.expert_parallel`), the router and shared experts whole.

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

from flashcp.models.config import ModelArgs
from flashcp.models.families.inventory import (  # noqa: F401 - the inventory, re-exported
    ParamSpec,
    held_experts,
    layer_buffers,
    layer_parameters,
    mtp_layer_parameters,
    stage_inventory,
)
from flashcp.pipeline.split import split_layers


def is_expert(spec: ParamSpec) -> bool:
    """A routed-experts tensor (stacked weight or its adapter): split by expert parallelism,
    its gradients reduced and its optimizer state sharded over the edp group."""
    return ".mlp.experts." in spec.name


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The index i of a parameter named `model.layers.{i}.*`; None outside the layers."""
    m = _LAYER.match(name)
    return None if m is None else int(m.group(1))


def is_mtp(spec: ParamSpec, args: ModelArgs) -> bool:
    """Whether `spec` belongs to an MTP layer (`model.layers.{i}` with i >= num_layers)."""
    index = layer_index(spec.name)
    return index is not None and index >= args.num_layers


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
    layers = stage_layers(args, stage, pp, pp_layers)
    specs = stage_inventory(args, layers, first=stage == 0, last=stage == pp - 1, ep=ep)
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
