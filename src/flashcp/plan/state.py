"""What a stage's ranks hold for the whole step, whatever the moment: its parameters in their
storage dtype, their gradients (or float32 accumulators, or the ZeRO-2 shard), float32 master
weights and AdamW moments (÷ the sharding degree), the DPO reference copy and the persistent
buffers — the base every moment of the stage starts from (`flashcp.plan.items.Moments`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashcp.pipeline.split import split_layers
from flashcp.plan.counts import Dtypes
from flashcp.plan.params import ParamSpec, is_expert, is_mtp, stage_buffers, stage_parameters
from flashcp.plan.setup import Setup, numel


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
    return StageState(
        stage=stage,
        layers=split_layers(args.num_layers, s.pp, s.pp_layers)[stage],
        first=stage == 0,
        last=stage == s.pp - 1,
        dt=dt,
        specs=specs,
        n_state=n_state,
        trained_bytes=PT,
        master=master,
        zero2=zero2,
        items=items,
    )
