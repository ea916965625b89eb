"""Every model family against transformers' own class: a tiny random model of each (ERNIE-4.5
dense and MoE, Llama-3.1 with llama3 RoPE scaling, Qwen2.5, Qwen3, Qwen3-MoE), every tensor
perturbed, saved by transformers (`save_pretrained`, its 5.x layout) and read by flashcp's
`model.from_pretrained`: float32 logits within `TOL` on whole sequences and on packed documents
(flashcp's causal-document mask against each document alone). Then the other way: one step of
training from that directory, `flashcp export`, and transformers loads the export with nothing
missing or unexpected and computes the trained model's logits.

Each family's shape exercises what makes it itself: ERNIE's interleaved full-head rotary, its
``use_bias`` and tied head, its router's correction bias (stored as ``moe_statics``), shared
experts, dense layer 0; Llama's scaled RoPE over a 16-token original context with 40-token
rows, attention and MLP biases; Qwen2's q/k/v-only biases and tied head; Qwen3's QK-norm and
head_dim 32 ≠ hidden / heads; Qwen3-MoE's ``mlp_only_layers`` and ``norm_topk_prob``. A negative
control per family shows the comparison catches a wrong model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashcp import masks
from flashcp.checkpoint.export import export_run
from flashcp.models import build_model
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.parallelize import default_model_factory
from helpers.configs import tiny_config
from helpers.trainruns import Fit

from .test_hf_reference import (
    HF,
    TOL,
    _close,
    _flashcp_logits,
    _hf_cfg,
    _hf_logits,
    _torch,
    _transformers,
    perturbed,
)

pytestmark = pytest.mark.hf

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    eos_token_id=[1, 2],
)
ROPE = {"rope_type": "default", "rope_theta": 2500.0}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(
        head_dim=16, use_bias=True, tie_word_embeddings=True, rope_parameters=ROPE,
    )),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        tie_word_embeddings=False, rope_parameters=ROPE, moe_num_experts=4, moe_k=2,
        moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=1,
    )),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=16, attention_bias=True, mlp_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 2500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    )),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True, use_sliding_window=False, rope_parameters=ROPE,
    )),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, attention_bias=True, rope_parameters=ROPE,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, rope_parameters=ROPE, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
    )),
}  # fmt: skip
"""arch → (transformers config class, model class, the family's own keys)."""
DOCS = [9, 14, 5, 12]


def _hf_model(arch: str) -> Any:
    tf = _transformers()
    config_cls, model_cls, own = FAMILIES[arch]
    _torch().manual_seed(sorted(FAMILIES).index(arch))
    config = getattr(tf, config_cls)(**BASE, **own, attn_implementation="eager")
    return perturbed(getattr(tf, model_cls)(config))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(directory), max_shard_size="100KB")
    return request.param, model, directory


def _wrong(arch: str, args: Any) -> Any:
    """What a plausible mistake of this family's reading would build (the negative control)."""
    if arch in ("ernie4_5", "ernie4_5_moe"):
        return dataclasses.replace(args, rotary_interleaved=False)  # half-split pairs
    if arch == "llama":
        return dataclasses.replace(args, rope_scaling="none")  # the llama3 scaling dropped
    if arch == "qwen2":
        return dataclasses.replace(args, rotary_base=10000.0)  # rope_theta not read
    if arch == "qwen3":
        return dataclasses.replace(args, head_dim=None, use_qk_norm=False)  # hidden / heads
    return dataclasses.replace(args, norm_topk_prob=False)  # qwen3_moe: weights not renormed


def test_from_pretrained_matches_transformers(saved: tuple) -> None:
    arch, hf, directory = saved
    cfg = _hf_cfg(directory)
    assert cfg.model.arch == arch
    model = default_model_factory(cfg)
    ids = np.random.default_rng(3).integers(3, 320, (2, 40))
    want = _hf_logits(hf, ids)
    _close(_flashcp_logits(model, ids, masks.causal_mask(2, 40)), want)
    wrong_args = _wrong(arch, cfg.model)
    try:
        wrong = build_model(wrong_args, seed=0)
        load_hf_checkpoint(wrong, directory)
    except ValueError:  # a shape the checkpoint does not have: caught at load, also a control
        return
    err = np.abs(_flashcp_logits(wrong, ids, masks.causal_mask(2, 40)) - want).max()
    assert err > 100 * TOL, (arch, err)


def test_packed_documents_match_each_document_alone(saved: tuple) -> None:
    arch, hf, directory = saved
    model = default_model_factory(_hf_cfg(directory))
    ids = np.random.default_rng(4).integers(3, 320, (1, sum(DOCS)))
    got = _flashcp_logits(model, ids, masks.causal_document_mask(DOCS, 1))
    start = 0
    for n in DOCS:
        _close(got[:, start : start + n], _hf_logits(hf, ids[:, start : start + n]))
        start += n
    leaky = _flashcp_logits(model, ids, masks.causal_mask(1, sum(DOCS)))
    assert np.abs(leaky[:, DOCS[0] :] - got[:, DOCS[0] :]).max() > 100 * TOL


def test_transformers_loads_a_flashcp_export(saved: tuple, tmp_path: Path, fit: Fit) -> None:
    """One step from the HF directory, `flashcp export`, transformers loads it: nothing
    missing or unexpected, the trained model's logits, and the tied head stays tied."""
    arch, hf_before, directory = saved
    cfg = tiny_config(
        tmp_path,
        base=HF,
        model={"from_pretrained": str(directory)},
        data={"seq_len": 32, "micro_batch_size": 2},
        train={"steps": 1, "lr": 1e-2, "warmup_steps": 0, "min_lr": 1e-3},
        checkpoint={"every": 1},
    )
    trainer = fit(cfg).trainer
    out = tmp_path / "export"
    export_run(tmp_path / "run", out, max_shard_bytes=60_000)
    tf = _transformers()
    cls = getattr(tf, FAMILIES[arch][1])
    hf, info = cls.from_pretrained(str(out), attn_implementation="eager", output_loading_info=True)
    hf.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.config.tie_word_embeddings == cfg.model.tie_embeddings
    ids = np.random.default_rng(5).integers(3, 320, (2, 40))
    want = _flashcp_logits(trainer.model, ids, masks.causal_mask(2, 40))
    _close(_hf_logits(hf, ids), want)
    assert np.abs(_hf_logits(hf_before, ids) - want).max() > 100 * TOL  # the step changed it


def test_a_paddleformers_ernie_moe_directory_reads_as_transformers_reads_it(
    tmp_path: Path,
) -> None:
    """PaddleFormers' own ``Ernie4_5_MoeForCausalLM`` (1.2.0), random weights, saved by its
    ``save_pretrained`` (its fused q/k/v and gate/up split back, its own config keys): flashcp
    computes what transformers computes from the same directory (PaddleFormers' own forward
    needs GPU kernels, so transformers is the reference)."""
    import paddle
    from paddleformers.transformers.ernie4_5_moe import (
        Ernie4_5_MoeConfig,
        Ernie4_5_MoeForCausalLM,
    )

    import flashcp

    paddle.seed(0)
    config = Ernie4_5_MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
        moe_layer_start_index=1, rope_theta=2500.0, num_nextn_predict_layers=0,
        dtype="float32", fuse_rms_norm=False,
    )  # fmt: skip
    model = Ernie4_5_MoeForCausalLM(config)
    with paddle.no_grad():  # no identity anywhere: norms 1 + noise, the correction bias too
        for name, p in model.named_parameters():
            noise = paddle.randn(p.shape, dtype=p.dtype) * (0.1 if len(p.shape) > 1 else 0.2)
            p.set_value(noise + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["paddleformers_version"]
    ours = flashcp.from_pretrained(tmp_path)
    tf = _transformers()
    hf, info = tf.Ernie4_5_MoeForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = np.random.default_rng(7).integers(3, 320, (2, 40))
    want = _hf_logits(hf.eval(), ids)
    _close(_flashcp_logits(ours, ids, masks.causal_mask(2, 40)), want)
    fresh = flashcp.from_pretrained(tmp_path)  # control: its correction bias zeroed
    for layer in fresh.decoder_layers()[1:]:
        bias = layer.mlp.gate.e_score_correction_bias
        bias.set_value(paddle.zeros_like(bias))
    err = np.abs(_flashcp_logits(fresh, ids, masks.causal_mask(2, 40)) - want).max()
    assert err > 100 * TOL
