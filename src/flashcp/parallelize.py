"""What is applied to this rank's freshly built stage, in one place and in order.

`parallelize(model, cfg, groups)` (torchtitan's `parallelize_llama` shape) takes the stage
`flashcp.models.build_model` built — the whole model at pp = 1, else this rank's pipeline stage,
with its ep rank's share of the routed experts — and applies, one step each:

1. expert parallel: every MoE layer holding a share of the experts gets the ep group it
   exchanges tokens over (`flashcp.models.expert_parallel.attach_exchange`);
2. activation recompute: the decoder layers run under `model.recompute` (`none` / `full` /
   `refined`; `flashcp.models.recompute`, which pins any `AttentionImpl` and its plan and knows
   no CP internals), and with `train.offload_activations` what they keep for backward waits in
   host memory (`flashcp.models.offload.apply_activation_offload`);
3. sequence tiling: the decoder layers run their token-wise parts over tiles of
   `model.tile_tokens` local tokens (`flashcp.models.tiling`; 0 = untiled);
4. LoRA: the `lora` section's adapters (`flashcp.lora.setup.apply_lora_config`), after which
   only they are trainable (adapters inside tiled projections run per tile with them);
5. MTP: with `model.mtp_loss_weight` 0 the MTP layers (`flashcp.models.mtp`) are carried
   frozen, adapters on them included (they never run); trained, they are like any layer.

Data and context parallelism need nothing here: dp is a gradient sum (`flashcp.optim`), cp
lives in each micro-batch's attention context (`flashcp.pipeline.runner.MicroBatch.of`).
Recipe business (DPO's frozen reference copy) is not applied here but by the recipe's `setup`,
on the parallelized stage.
"""

from __future__ import annotations

import paddle

from flashcp.config import Config
from flashcp.distributed import ParallelGroups
from flashcp.lora.setup import LoRASetup, apply_lora_config
from flashcp.models.base import DecoderLayer, DecoderStack
from flashcp.models.config import RECOMPUTE_MODES
from flashcp.models.expert_parallel import attach_exchange
from flashcp.models.mtp import freeze_mtp_layers
from flashcp.models.offload import apply_activation_offload
from flashcp.models.tiling import check_tile_tokens


def apply_expert_parallel(model: paddle.nn.Layer, groups: ParallelGroups) -> int:
    """Attach the ep group to the stage's expert-parallel MoE layers; returns how many."""
    if int(groups.ep.nranks) == 1:
        return 0
    return attach_exchange(model, groups.ep_exchange())


def apply_recompute(model: paddle.nn.Layer, mode: str) -> None:
    """Run the stage's decoder layers under activation recompute `mode`."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {mode!r}: use one of {', '.join(RECOMPUTE_MODES)}")
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, DecoderStack):
            layer.recompute = mode


def apply_tiling(model: paddle.nn.Layer, tile_tokens: int) -> None:
    """Run the stage's decoder layers over tiles of `tile_tokens` local tokens (0: untiled)."""
    tile = check_tile_tokens(tile_tokens)
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, DecoderLayer):
            layer.tile_tokens = tile


def apply_lora(model: paddle.nn.Layer, cfg: Config, groups: ParallelGroups) -> LoRASetup | None:
    """The `lora` section's adapters on the stage (target patterns checked over every stage,
    adapters keyed by `train.seed`); None without the section."""
    section = cfg.extras.get("lora")
    if section is None:
        return None
    return apply_lora_config(model, section, group=groups.pp, seed=cfg.train.seed)


def parallelize(model: paddle.nn.Layer, cfg: Config, groups: ParallelGroups) -> LoRASetup | None:
    """Expert parallel → recompute → tiling → LoRA → MTP on this rank's stage `model`, in place (see
    the module docstring); returns the LoRA setup the adapter files need, None without LoRA."""
    apply_expert_parallel(model, groups)
    apply_recompute(model, cfg.model.recompute)
    apply_activation_offload(model, cfg.train.offload_activations)
    apply_tiling(model, cfg.model.tile_tokens)
    lora = apply_lora(model, cfg, groups)
    if not cfg.model.mtp_trained:
        freeze_mtp_layers(model)
    return lora
