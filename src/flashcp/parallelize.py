"""This rank's stage of the model: built, parallelized in one place and in order, and run.

`build_stage` builds a rank's part of the model (`default_model_factory`: its pipeline stage
and ep share, from `train.seed` or `checkpoint.init_from`) and parallelizes it; `build_runner`
is the pipeline runner over it. Training (`flashcp.trainer`) and `flashcp eval`
(`flashcp.evaluation.command`) build their ranks with these two.

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

import dataclasses
from collections.abc import Callable
from typing import Any

import paddle

from flashcp import fa_dispatch
from flashcp.config import Config
from flashcp.distributed import ParallelGroups, barrier
from flashcp.log import log_once
from flashcp.lora.setup import LoRASetup, apply_lora_config
from flashcp.models import build_model
from flashcp.models.base import DecoderLayer, DecoderStack, StageSpec
from flashcp.models.config import RECOMPUTE_MODES
from flashcp.models.expert_parallel import attach_exchange
from flashcp.models.hf_config import directory_notes
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.models.mtp import freeze_mtp_layers
from flashcp.models.offload import apply_activation_offload
from flashcp.models.tiling import check_tile_tokens
from flashcp.pipeline.runner import PipelineRunner
from flashcp.pipeline.stage import stage_spec
from flashcp.rank_setup import forward_context


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


def default_model_factory(cfg: Config, stage: StageSpec | None = None) -> paddle.nn.Layer:
    """Build the configured model — only pipeline stage `stage` of it when given — directly in
    `train.param_dtype`, initialised from `train.seed` (`flashcp.models.build_model`), or
    with `checkpoint.init_from` filled from that checkpoint instead (every parameter is read
    from it, so none is drawn first)."""
    fresh = cfg.checkpoint.init_from is None
    model = build_model(cfg.model, stage=stage, param_dtype=cfg.train.param_dtype,
                        seed=cfg.train.seed, initialise=fresh)  # fmt: skip
    init_weights(model, cfg)
    return model


def init_weights(model: paddle.nn.Layer, cfg: Config, *, on_tensor: Any = None) -> Any:
    """Load the HF-layout weights named by `checkpoint.init_from`, if any (strict keys/shapes).

    `model` is the whole model or one pipeline stage: a stage reads only its own tensors.
    `on_tensor` and the returned `LoadReport` (None without init_from): see
    `flashcp.models.hf_load.load_hf_checkpoint`.
    """
    if cfg.checkpoint.init_from is None:
        return None
    if cfg.model_from_pretrained is not None:
        for note in directory_notes(cfg.model_from_pretrained, cfg.model.mtp_layers):
            log_once(f"hf-config-note:{note}", note)
    return load_hf_checkpoint(model, cfg.checkpoint.init_from, on_tensor=on_tensor)


def build_stage(
    cfg: Config,
    groups: ParallelGroups,
    model_factory: Callable[[Config, StageSpec], paddle.nn.Layer] | None = None,
) -> tuple[paddle.nn.Layer, StageSpec, LoRASetup | None]:
    """This rank's part of the model: its pipeline stage and ep share built by
    `model_factory` (default: `default_model_factory`), every rank met after the build (load
    times differ), then parallelized (`flashcp.parallelize`); with its spec and LoRA setup."""
    stage = stage_spec(
        cfg.model, int(groups.pp.rank), int(groups.pp.nranks), cfg.parallel.pp_layers
    )
    spec = dataclasses.replace(stage, ep_rank=int(groups.ep.rank), ep_size=cfg.parallel.ep)
    model = (model_factory or default_model_factory)(cfg, spec)
    # Load times differ between ranks (weights from shared storage): meet here first.
    barrier(groups.world, op="barrier after building the model")
    lora = parallelize(model, cfg, groups)
    return model, spec, lora


def build_runner(
    cfg: Config, groups: ParallelGroups, model: paddle.nn.Layer, dtype: str
) -> PipelineRunner:
    """The pipeline runner of this rank's stage under the config's layout."""
    return PipelineRunner(
        model, groups, kind=cfg.parallel.pp_schedule,  # type: ignore[arg-type]
        forward_context=forward_context(dtype), cp_mode=cfg.parallel.cp_mode,
        fa4_unavailable=fa_dispatch.resolve_policy(cfg.attention.fa4_unavailable),
        query_chunk=cfg.attention.query_chunk, kv_chunk=cfg.attention.kv_chunk,
        mtp_depth=cfg.model.mtp_layers if cfg.model.mtp_trained else 0,
    )  # fmt: skip
