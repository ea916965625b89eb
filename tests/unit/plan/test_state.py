"""A stage's persistent items (`flashcp.plan.state.stage_state`) against the built stage.

Each item is pinned exactly, byte for byte, against what the stage really holds: its built
parameters and buffers (in the storage dtype, LoRA applied and the MTP layers frozen as
`flashcp.parallelize` does), Paddle's own AdamW state after one step, and a deep copy for DPO's
reference. The settings each case varies are the ones the items depend on: the pipeline's
layer split, bf16 storage under LoRA, a frozen MTP layer with adapters, ZeRO-2 and the
gradients kept across micro-batches.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.config import build_config
from flashcp.lora.model import apply_lora
from flashcp.models.mtp import freeze_mtp_layers
from flashcp.pipeline.stage import build_stage
from flashcp.plan.features import Features
from flashcp.plan.setup import Setup, setup
from flashcp.plan.state import stage_state

LORA = [".*q_proj", ".*eh_proj", ".*mlp\\.experts"]


def _setup(model: dict[str, Any], **fields: Any) -> Setup:
    return dataclasses.replace(setup(build_config({"model": model}), device="cpu"), **fields)


def _stage(s: Setup, stage: int) -> paddle.nn.Layer:
    """Stage `stage` as the trainer builds it for `s`."""
    module = build_stage(s.args, stage, s.pp, s.pp_layers, param_dtype=s.param_dtype, seed=0)
    if s.lora_targets:
        apply_lora(module, rank=s.lora_rank, alpha=8.0, target_modules=s.lora_targets,
                   require_match=False)  # fmt: skip
    if not s.args.mtp_trained:
        freeze_mtp_layers(module)
    return module


def _bytes(tensors: Any) -> int:
    return sum(int(np.prod(t.shape)) * t.element_size() for t in tensors)


def _adamw_state_bytes(trained: list[paddle.Tensor]) -> int:
    """Paddle's AdamW state after one step on `trained` (float32 copies, as the masters are)."""
    params = [paddle.create_parameter(list(p.shape), "float32") for p in trained]
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=params)
    for p in params:
        p.grad = paddle.ones_like(p)  # type: ignore[misc]
    opt.step()
    return sum(_bytes(acc.values()) for acc in opt._accumulators.values())


CASES = {
    # uneven pipeline split: stage 0 holds one layer, stage 1 three and the MTP layer
    "pp_layers": ({"preset": "tiny_glm_moe", "num_layers": 4, "mtp_layers": 1},
                  {"pp": 2, "pp_layers": [1, 3]}),
    # a frozen MTP layer whose eh_proj carries float32 adapters, bf16 storage, LoRA
    "frozen_mtp_lora_bf16": ({"preset": "tiny_glm_moe", "mtp_layers": 1},
                             {"param_dtype": "bfloat16", "lora_targets": LORA, "lora_rank": 4}),
    # full fine-tuning with a frozen MTP layer: DPO copies all of it
    "dpo_frozen_mtp": ({"preset": "tiny_glm_moe", "mtp_layers": 1}, {"dpo": True}),
    "dense_bf16": ({"preset": "tiny_glm"}, {"param_dtype": "bfloat16"}),
    # a trained MTP layer in bf16 storage: its own item, float32 masters and main_grads
    "trained_mtp_bf16": ({"preset": "tiny_glm_moe", "mtp_layers": 1, "mtp_loss_weight": 0.3},
                         {"param_dtype": "bfloat16"}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_stage_items_equal_the_built_stage(case: str) -> None:
    model, fields = CASES[case]
    s = _setup(model, **fields)
    assert s.args.mtp_layers == model.get("mtp_layers", 0)
    buffers = 0
    for stage in range(s.pp):
        state = stage_state(s, stage)
        module = _stage(s, stage)
        params = dict(module.named_parameters())
        mtp = {n for n in params if n.startswith(f"model.layers.{s.args.num_layers}.")}
        trained = [p for p in params.values() if not p.stop_gradient]
        items = state.items
        assert items["mtp_params"] == _bytes(params[n] for n in mtp)
        assert items["params_trained"] == _bytes(
            p for n, p in params.items() if not p.stop_gradient and n not in mtp
        )
        assert items["params_frozen"] == _bytes(
            p for n, p in params.items() if p.stop_gradient and n not in mtp
        )
        assert items["buffers"] == _bytes(module.buffers())
        buffers += items["buffers"]  # the MoE routers' score-correction biases
        trained_numel = sum(int(np.prod(p.shape)) for p in trained)
        bf16 = s.param_dtype == "bfloat16" and not s.lora_targets
        assert items["gradients"] == (0 if bf16 else 4 * trained_numel)
        assert items["main_grads"] == (4 * trained_numel if bf16 else 0)
        assert items["master_weights"] == (4 * trained_numel if bf16 else 0)
        assert items["grad_shard"] == 0
        assert items["optimizer_states"] == _adamw_state_bytes(trained)
        reference = _bytes(copy.deepcopy(module).parameters()) if s.dpo else 0
        assert items["dpo_reference"] == reference
        layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert set(state.layers) == layers - {s.args.num_layers}
        assert (state.stage, state.first, state.last) == (stage, stage == 0, stage == s.pp - 1)
        assert state.trained_bytes == trained[0].element_size()  # LoRA adapters: float32
        assert state.master == bf16
    assert (buffers > 0) == bool(s.args.num_experts)


def test_zero2_shards_the_gradients_and_the_state() -> None:
    """ZeRO-2 over dp·cp = 4 ranks, the routed experts over their edp group (dp·cp / ep = 2):
    each rank keeps its shard of the float32 gradients and of the AdamW moments, and no full
    gradient; without gradient sharding, full gradients and no shard."""
    zero = {"dp": 2, "cp": 2, "ep": 2, "shard": True}
    s = _setup({"preset": "tiny_glm_moe"}, **zero,
               features=Features(shard_gradients=True))  # fmt: skip
    module = build_stage(s.args, 0, 1, seed=0)  # every expert; an ep rank holds 1/ep of them
    named = {n: int(np.prod(p.shape)) for n, p in module.named_parameters()}
    all_experts = sum(v for n, v in named.items() if ".mlp.experts." in n)
    experts, rest = all_experts // s.ep, sum(named.values()) - all_experts
    shard = math.ceil(rest / 4) + math.ceil(experts / 2)
    state = stage_state(s, 0)
    assert state.zero2 and state.n_state == shard
    assert state.items["grad_shard"] == 4 * shard and state.items["gradients"] == 0
    assert state.items["optimizer_states"] == 8 * shard + 8 * len(named)
    plain = stage_state(dataclasses.replace(s, features=Features()), 0)
    assert not plain.zero2 and plain.items["grad_shard"] == 0
    assert plain.items["gradients"] == 4 * (rest + experts)


@pytest.mark.parametrize(
    ("fields", "kept", "in_forward"),
    [
        ({}, False, False),
        ({"grad_accum": 2}, True, True),
        ({"pp": 2}, True, True),  # 1F1B: an earlier micro-batch's backward ran before
        ({"pp": 2, "schedule": "gpipe"}, True, False),  # every forward before any backward
    ],
)
def test_gradients_kept_across_micro_batches(
    fields: dict[str, Any], kept: bool, in_forward: bool
) -> None:
    state = stage_state(_setup({"preset": "tiny_glm", "num_layers": 2}, **fields), 0)
    assert (state.grads_kept, state.grads_in_forward) == (kept, in_forward)
    full = state.items["gradients"]
    assert state.live_grads("forward") == {"gradients": full if in_forward else 0}
    assert (state.live_grads("head")["gradients"] == full) == kept


@pytest.mark.parametrize("chunk", [0, 1, 4096])
def test_the_head_gradient_exists_from_the_first_chunk(chunk: int) -> None:
    """With a chunked loss (any `chunk` > 0, one token included) each chunk's head gradient
    adds into the first one's, so it exists while later chunks back-propagate; unchunked
    it forms at once with the rest of the head's backward."""
    state = stage_state(_setup({"preset": "tiny_glm"}, chunk=chunk), 0)
    head = sum(x.numel for x in state.specs if x.name in ("lm_head.weight", "model.norm.weight"))
    assert state.grad_elements["head"] == (head if chunk else 0)


def test_the_stage_dtypes_follow_the_setup() -> None:
    """Compute dtype, device and residual dtype all reach the stage's `Dtypes`."""
    s = _setup({"preset": "tiny_glm"})
    dt = stage_state(s, 0).dt
    assert (dt.c, dt.gpu, dt.boundary) == (4, False, 4)
    gpu = dataclasses.replace(s, device="gpu", compute="bfloat16",
                              features=Features(residual_dtype="bfloat16"))  # fmt: skip
    dt = stage_state(gpu, 0).dt
    assert (dt.c, dt.gpu, dt.boundary) == (2, True, 2)


def test_released_gradient_bytes_are_whole_shares_of_the_item() -> None:
    """Without kept gradients each moment holds the formed elements' share of the gradient
    item, in whole bytes; with them, the whole item at every layer."""
    s = _setup({"preset": "tiny_glm", "num_layers": 2})
    state = stage_state(s, 0)
    full, n = state.items["gradients"], state.n_trained
    for i in state.layers:
        got = state.layer_grads(i)
        assert got == tuple(full * e // n for e in state.layer_grad_elements[i])
        assert all(isinstance(b, int) for b in got) and got[0] < got[1] <= full
    moment = state.live_grads("embedding")["gradients"]
    assert isinstance(moment, int) and moment == full * state.grad_elements["embedding"] // n
    kept = stage_state(dataclasses.replace(s, grad_accum=2), 0)
    assert all(kept.layer_grads(i) == (full, full) for i in kept.layers)


def test_the_mtp_depths_gradients_form_before_the_layers() -> None:
    """Trained MTP depths back-propagate right after the head: while they do, the head's
    gradients and theirs exist but their embeddings' (formed last, `flashcp.models.mtp`); the
    top decoder layer's backward starts with all of them."""
    s = _setup({"preset": "tiny_glm_moe", "mtp_layers": 1, "mtp_loss_weight": 0.3})
    state = stage_state(s, 0)
    numel = {x.name: x.numel for x in state.specs if x.trained}
    depth = f"model.layers.{s.args.num_layers}."
    mtp = sum(v for n, v in numel.items() if n.startswith(depth))
    mtp_embedding = numel[depth + "embed_tokens.weight"]
    head = numel["lm_head.weight"] + numel["model.norm.weight"]
    assert 0 < mtp_embedding < mtp
    assert state.grad_elements["mtp"] == head + mtp - mtp_embedding
    top = s.args.num_layers - 1
    top_mlp = sum(v for n, v in numel.items() if n.startswith(f"model.layers.{top}.mlp.")
                  or n.startswith(f"model.layers.{top}.post_attention_layernorm"))  # fmt: skip
    assert state.layer_grad_elements[top][0] == head + mtp + top_mlp
    embedding = numel["model.embed_tokens.weight"]
    assert state.grad_elements["embedding"] == sum(numel.values()) - embedding


def test_pipeline_stages_hold_only_their_own_head_and_embedding_gradients() -> None:
    """Stage 0 of two has no head (no head gradient at the head moment, chunked or not) and
    stage 1 no embedding (every gradient exists while the embedding's would form); a stage
    that trains nothing (LoRA on the head only) has no ZeRO-2 gradient shard."""
    s = _setup({"preset": "tiny_glm", "num_layers": 2}, pp=2)
    first, last = stage_state(s, 0), stage_state(s, 1)
    assert first.grad_elements["head"] == 0 < last.grad_elements["head"]
    assert last.grad_elements["embedding"] == last.n_trained
    assert first.grad_elements["embedding"] == first.n_trained - first.specs[0].numel
    assert first.specs[0].name == "model.embed_tokens.weight"
    frozen = dataclasses.replace(s, lora_targets=["lm_head"], lora_rank=4, dp=2, shard=True,
                                 features=Features(shard_gradients=True))  # fmt: skip
    idle, head = stage_state(frozen, 0), stage_state(frozen, 1)
    assert idle.n_trained == 0 and not idle.zero2 and idle.items["grad_shard"] == 0
    assert head.n_trained > 0 and head.zero2
