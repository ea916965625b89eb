"""What a stage's ranks hold for the whole step, whatever the moment: its parameters in their
storage dtype, their gradients (or float32 accumulators, or the ZeRO-2 shard), float32 master
weights and AdamW moments (÷ the sharding degree), the DPO reference copy and the persistent
buffers — the base every moment of the stage starts from (`flashcp.plan.items.Moments`).

Gradients are released after every step (`clear_grad`), so with one micro-batch per step and
one stage they exist only from the backward that forms them to the optimizer step:
`StageState.live_grads` says which exist at each kind of moment."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flashcp.models.config import ModelArgs
from flashcp.pipeline.split import split_layers
from flashcp.plan.counts import Dtypes
from flashcp.plan.params import (
    ParamSpec,
    is_expert,
    is_mtp,
    layer_index,
    stage_buffers,
    stage_parameters,
)
from flashcp.plan.setup import Setup, numel

GRAD_MOMENTS = ("forward", "head", "mtp", "embedding")
"""The kinds of moment by the gradients formed, in backward's order: none in a forward nor
while the head's weight gradient forms (`weight_grad_transient`, which then becomes it; a
chunked loss's later chunks add to it); the head's while the trained MTP depths
back-propagate (their own but their embeddings', formed last); every one but the untied
embedding's while the embedding's own forms. Between them the layers' backward
(`StageState.layer_grads`)."""


def _layer_part(name: str) -> str | None:
    """Which part of its layer's backward forms the gradient of parameter `name`: ``mlp``
    (first: the MLP and its norm) or ``attention`` (the projections and the input norm); None
    outside a decoder layer."""
    index = layer_index(name)
    if index is None:
        return None
    local = name.removeprefix(f"model.layers.{index}.")
    return "attention" if local.startswith(("self_attn.", "input_layernorm")) else "mlp"


def _grad_elements(
    specs: list[ParamSpec], args: ModelArgs, layers: range, chunked: bool
) -> tuple[dict[str, int], dict[int, tuple[int, int]]]:
    """`StageState.grad_elements` and `layer_grad_elements` of a stage's parameters."""
    trained = [x for x in specs if x.trained]
    n = sum(x.numel for x in trained)
    named = {x.name: x.numel for x in trained}
    embedding = named.get("model.embed_tokens.weight", 0)
    head = named.get("lm_head.weight", 0) + named.get("model.norm.weight", 0)
    if args.tie_embeddings:  # the head's gradient is the embedding's, formed first
        head, embedding = head + embedding, 0
    mtp = [x for x in trained if is_mtp(x, args)]
    mtp_embeddings = sum(x.numel for x in mtp if x.name.endswith(".embed_tokens.weight"))
    parts = {i: {"mlp": 0, "attention": 0} for i in layers}
    for x in trained:
        index, part = layer_index(x.name), _layer_part(x.name)
        if index in parts and part is not None:
            parts[index][part] += x.numel
    per_layer, above = {}, head + sum(x.numel for x in mtp)
    for index in reversed(layers):
        mlp = above + parts[index]["mlp"]
        above = mlp + parts[index]["attention"]
        per_layer[index] = (mlp, above)  # (its MLP's backward, its attention's)
    kinds = {"forward": 0, "head": head if chunked else 0,
             "mtp": head + sum(x.numel for x in mtp) - mtp_embeddings,
             "embedding": n - embedding}  # fmt: skip
    return kinds, per_layer


@dataclass(frozen=True)
class StageState:
    """A stage's parameters and the persistent bytes they bring (`items`)."""

    stage: int
    layers: range
    """The decoder layers the stage runs (`flashcp.pipeline.split`)."""
    first: bool
    last: bool
    dt: Dtypes
    specs: list[ParamSpec]
    """The stage's parameters as each rank builds them (its ep share of the experts)."""
    n_state: int
    """Elements of this rank's optimizer shard: the routed experts over their edp group
    (dp·cp/ep ranks), the rest over dp × cp (1 without ZeRO-1)."""
    trained_bytes: int
    """Bytes per trained element: train.param_dtype's, but LoRA adapters stay float32
    (`flashcp.lora.model`)."""
    master: bool
    """Float32 master weights exist (bf16 storage, or ZeRO-1)."""
    zero2: bool
    """ZeRO-2: no full-size gradient outlives its bucket; the float32 shard persists."""
    items: dict[str, int]
    """The persistent items (bytes)."""
    grads_kept: bool = True
    """Gradients exist at every backward moment: an earlier micro-batch's (`train.grad_accum`
    > 1, or a pipeline's several micro-batches). Otherwise each step starts without any."""
    grads_in_forward: bool = True
    """... and at every forward moment too: not with one micro-batch, nor under GPipe, whose
    forwards all run before its first backward."""
    grad_elements: dict[str, int] = field(default_factory=dict)
    """Trained elements whose gradients exist by each kind of moment (`GRAD_MOMENTS`) when
    the step starts without any."""
    layer_grad_elements: dict[int, tuple[int, int]] = field(default_factory=dict)
    """The same while decoder layer i (global index) back-propagates its MLP, then its
    attention: the head's, the MTP depths', those of the layers above it and the part's own
    and earlier ones (a weight gradient forms during its part's backward and becomes the
    `.grad`; the working sets, measured with every gradient allocated, do not hold it)."""

    @property
    def trained(self) -> list[ParamSpec]:
        return [x for x in self.specs if x.trained]

    @property
    def n_trained(self) -> int:
        return numel(self.specs, True)

    @property
    def largest(self) -> int:
        """Elements of the largest trained parameter (0: nothing trained)."""
        return max((x.numel for x in self.trained), default=0)

    @property
    def grad_item(self) -> str:
        """The item the gradients are in: ``main_grads`` under bf16 storage (float32
        accumulators), else ``gradients`` (0 bytes under ZeRO-2: ``grad_shard``)."""
        return "main_grads" if self.items["main_grads"] else "gradients"

    def live_grads(self, when: str) -> dict[str, int]:
        """The gradient item at a moment of kind `when` (`GRAD_MOMENTS`): all of it when kept,
        else the share formed by then."""
        kept = self.grads_in_forward if when == "forward" else self.grads_kept
        return {self.grad_item: self._share(self.grad_elements[when], kept)}

    def layer_grads(self, index: int) -> tuple[int, int]:
        """Bytes of gradients live while decoder layer `index` back-propagates its MLP, then
        its attention."""
        mlp, attention = self.layer_grad_elements[index]
        return self._share(mlp, self.grads_kept), self._share(attention, self.grads_kept)

    def _share(self, formed: int, kept: bool) -> int:
        full = self.items[self.grad_item]
        if kept or not self.n_trained:
            return full
        return full * formed // self.n_trained


def stage_state(s: Setup, stage: int) -> StageState:
    """The persistent state of `stage` (module docstring)."""
    args = s.args
    dt = Dtypes.of(s.compute, s.param_dtype, s.device, s.features.residual_dtype)
    P = dt.param
    specs = stage_parameters(
        args, stage, s.pp, s.pp_layers, lora_targets=s.lora_targets, lora_rank=s.lora_rank,
        ep=s.ep,
    )  # fmt: skip
    trained = [x for x in specs if x.trained]
    n_trained, n_frozen = numel(specs, True), numel(specs, False)
    n_expert = sum(x.numel for x in trained if is_expert(x))
    n_state = math.ceil((n_trained - n_expert) / s.shard_degree) + math.ceil(
        n_expert / s.expert_shard_degree
    )
    PT = 4 if s.lora_targets is not None else P
    master = PT != 4 or s.shard
    zero2 = s.features.shard_gradients and s.shard and n_trained > 0
    # the MTP layers' weights, an item of their own (`flashcp.models.mtp`)
    # (trained: PT; frozen: P, but frozen LoRA adapters on them stay float32)
    mtp_trained = sum(x.numel for x in specs if x.trained and is_mtp(x, args))
    mtp_frozen = sum(x.numel for x in specs if not x.trained and is_mtp(x, args))
    mtp_adapters = sum(
        x.numel
        for x in specs
        if not x.trained and is_mtp(x, args) and x.name.endswith(("lora_A", "lora_B"))
    )
    items = {
        "params_trained": (n_trained - mtp_trained) * PT,
        "params_frozen": (n_frozen - mtp_frozen) * P,
        "mtp_params": mtp_trained * PT + (mtp_frozen - mtp_adapters) * P + mtp_adapters * 4,
        "buffers": numel(stage_buffers(args, stage, s.pp, s.pp_layers)) * 4,
        # bf16 storage: fleet's main_grad hooks add each gradient into float32 `main_grad` and
        # release the bf16 `.grad` (`flashcp.optim.trainable.attach_main_grad`).
        "gradients": n_trained * PT if PT == 4 and not zero2 else 0,
        "main_grads": n_trained * 4 if PT != 4 and not zero2 else 0,
        "grad_shard": n_state * 4 if zero2 else 0,
        "master_weights": n_state * 4 if master else 0,
        "optimizer_states": 2 * 4 * n_state + 8 * len(trained),
        "dpo_reference": (n_trained + n_frozen) * P if s.dpo and s.lora_targets is None else 0,
    }
    stage_layers = split_layers(args.num_layers, s.pp, s.pp_layers)[stage]
    kinds, from_layer = _grad_elements(specs, args, stage_layers, s.chunk > 0)
    return StageState(
        stage=stage,
        layers=stage_layers,
        first=stage == 0,
        last=stage == s.pp - 1,
        dt=dt,
        specs=specs,
        n_state=n_state,
        trained_bytes=PT,
        master=master,
        zero2=zero2,
        items=items,
        grads_kept=s.grad_accum > 1 or s.pp > 1,
        grads_in_forward=(s.grad_accum > 1 or s.pp > 1) and s.schedule != "gpipe",
        grad_elements=kinds,
        layer_grad_elements=from_layer,
    )
