"""LoRA on the routed experts: PaddleFormers' ``LoRAMoeExperts`` over flashcp's stacked experts.

The routed experts of an MoE layer are one `flashcp.models.experts.GroupedExperts` sublayer
(``model.layers.{i}.mlp.experts``) with stacked weights ``gate_up_proj`` `[E, H, 2I]` and
``down_proj`` `[E, I, H]` — the layout of PaddleFormers' ``MoeExperts``, whose LoRA wrapper
``LoRAMoeExperts`` adds per-expert adapters to both::

    gate_up_proj_lora_A [E, H, r], gate_up_proj_lora_B [E, r, 2I]
    down_proj_lora_A    [E, I, r], down_proj_lora_B    [E, r, H]

so expert `e` computes with ``W[e] + A[e] · B[e] · alpha / r`` (B starts at zero). A target
pattern adapts the experts of a layer by matching the ``...mlp.experts`` sublayer (e.g.
``.*mlp\\.experts``); per-expert projections are not separate layers any more.

PaddleFormers picks its MoE LoRA class by the experts layer's class name
(``MOE_EXPERTS_LORA_MAPPING``) once the layer is a ``MoeExpertsBase``: `prepare_targets`
switches the targeted `GroupedExperts` to `PFGroupedExperts` (the same layer, also a
``MoeExpertsBase``; flashcp's models do not import PaddleFormers) and maps that name to
`GroupedLoRAExperts`, a ``LoRAMoeExperts`` whose forward is flashcp's grouped compute (the
base projection plus ``dropout(x) · A · B · scaling``, each through the same grouped matmul)
instead of PaddleFormers' per-expert loop. Saving, loading (``LoRAModel.from_pretrained``),
merging and freezing are PaddleFormers' own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import paddle
from paddle import nn

from flashcp.models.experts import ExpertLayout, GroupedExperts
from flashcp.models.init import InitRule, fill_parameter
from flashcp.models.precision import float32_math

PROJECTIONS = ("gate_up_proj", "down_proj")
EXPERT_ATTRS = ("hidden_size", "intermediate_size", "first_expert", "total_experts", "layout")
"""What a wrapper keeps of the `GroupedExperts` it adapts (besides `num_experts`)."""
_CLASSES: dict[str, type] = {}


def _classes() -> dict[str, type]:
    """`PFGroupedExperts` and `GroupedLoRAExperts`, defined on first use (PaddleFormers'
    import takes a second) and registered with PaddleFormers' MoE LoRA mapping."""
    if _CLASSES:
        return _CLASSES
    from paddleformers.nn.experts import MoeExpertsBase
    from paddleformers.peft.lora import lora_model
    from paddleformers.peft.lora.lora_layers import LoRAMoeExperts

    class PFGroupedExperts(GroupedExperts, MoeExpertsBase):  # type: ignore[misc, valid-type]
        """A `GroupedExperts` PaddleFormers' LoRAModel recognises as MoE experts."""

    class GroupedLoRAExperts(LoRAMoeExperts):  # type: ignore[misc, valid-type]
        """PaddleFormers' LoRAMoeExperts (its parameters, merge, freezing) computing with
        flashcp's grouped path (see the module docstring)."""

        STACKED_EXPERTS = True

        def __init__(self, base_layer: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(base_layer, *args, **kwargs)
            for attr in EXPERT_ATTRS:
                setattr(self, attr, getattr(base_layer, attr))
            p = float(kwargs.get("lora_dropout", 0.0))
            self.lora_dropout = nn.Dropout(p) if p > 0 else (lambda x: x)

        plan = GroupedExperts.plan
        forward = GroupedExperts.forward

        def row_dtype(self, x: paddle.Tensor) -> paddle.dtype:
            """The activations' dtype: the float32 adapters take the rows unrounded (no cast
            before dispatch, unlike bf16 experts without adapters)."""
            return x.dtype

        def project(self, name: str, x: paddle.Tensor, layout: ExpertLayout) -> paddle.Tensor:
            out = layout.matmul(x, getattr(self, name))
            if self.disable_lora or self.merged:
                return out
            a, b = getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")
            delta = layout.matmul(layout.matmul(self.lora_dropout(x), a), b)
            return out + delta * self.scaling

        @paddle.no_grad()
        def _fold(self, sign: float) -> None:
            for name in PROJECTIONS:
                w = getattr(self, name)
                with float32_math():  # float32 on GPU too: no TF32
                    delta = paddle.bmm(
                        getattr(self, f"{name}_lora_A").astype("float32"),
                        getattr(self, f"{name}_lora_B").astype("float32"),
                    )
                folded = w.astype("float32") + delta * (sign * float(self.scaling))
                paddle.assign(folded.astype(w.dtype), output=w)

        def merge(self) -> None:
            """W += A·B·scaling per expert, in float32, stored back in W's dtype."""
            if not self.merged:
                self._fold(1.0)
                self.merged = True

        def unmerge(self) -> None:
            if self.merged:
                self._fold(-1.0)
                self.merged = False

    lora_model.MOE_EXPERTS_LORA_MAPPING[PFGroupedExperts.__name__] = GroupedLoRAExperts
    _CLASSES.update(base=PFGroupedExperts, lora=GroupedLoRAExperts)
    return _CLASSES


def is_expert_lora(layer: nn.Layer) -> bool:
    """Whether `layer` is a LoRA-adapted stacked-experts layer."""
    return bool(_CLASSES) and isinstance(layer, _CLASSES["lora"])


def prepare_targets(model: nn.Layer, patterns: Sequence[str]) -> int:
    """Make the `GroupedExperts` layers whose names match `patterns` (`re.fullmatch`)
    PaddleFormers MoE experts (`PFGroupedExperts`); returns how many."""
    regexes = [re.compile(p) for p in patterns]
    targeted = [
        layer
        for name, layer in model.named_sublayers()
        if isinstance(layer, GroupedExperts) and any(r.fullmatch(name) for r in regexes)
    ]
    if targeted:
        base = _classes()["base"]
        for layer in targeted:
            layer.__class__ = base
    return len(targeted)


def init_expert_adapters(name: str, layer: nn.Layer, seed: int) -> None:
    """Adapters from (seed, name, expert): each expert's A uniform in ±1/sqrt(in) (as a
    Linear's), keyed per expert like the stacked weights; B zeros."""
    for proj in PROJECTIONS:
        a = getattr(layer, f"{proj}_lora_A")
        rule = InitRule("uniform", 1.0 / math.sqrt(int(a.shape[1])), True, layer.first_expert)
        fill_parameter(a, seed, f"{name}.{proj}_lora_A", rule)
        b = getattr(layer, f"{proj}_lora_B")
        fill_parameter(b, seed, f"{name}.{proj}_lora_B", InitRule("zeros"))


def plain_experts(layer: nn.Layer) -> GroupedExperts:
    """A plain `GroupedExperts` sharing `layer`'s (merged) stacked weights (built without
    creating weights of its own)."""
    out = GroupedExperts.__new__(GroupedExperts)
    nn.Layer.__init__(out)
    for attr in ("num_experts", *EXPERT_ATTRS):
        setattr(out, attr, getattr(layer, attr))
    out.act_fn = layer.act_fn
    for proj in PROJECTIONS:
        setattr(out, proj, getattr(layer, proj))
    return out


def merged_piece(layer: nn.Layer, proj: str, expert: int, columns: Any) -> paddle.Tensor:
    """Expert `expert`'s ``W + A·B·scaling`` of projection `proj` (float32, stored back in W's
    dtype), Paddle layout, only `columns` of it when given."""
    if getattr(layer, "merged", False):
        raise RuntimeError("the adapters are already merged into the base weights")
    with paddle.no_grad(), float32_math():  # float32 on GPU too: no TF32
        w = getattr(layer, proj)[expert].astype("float32")
        a = getattr(layer, f"{proj}_lora_A")[expert].astype("float32")
        b = getattr(layer, f"{proj}_lora_B")[expert].astype("float32")
        out = (w + paddle.matmul(a, b) * float(layer.scaling)).astype(getattr(layer, proj).dtype)
        if columns is not None:
            out = out[:, columns[0] : columns[1]]
        return out
