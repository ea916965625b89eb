"""The reference implementation itself: tiny random `Glm4ForCausalLM` / `Glm4MoeForCausalLM`
built and saved by transformers (PyTorch CPU), loaded through `model.from_pretrained`, logits
compared in float32 — whole sequences, and packed documents (flashcp's causal-document mask)
against HF on each document alone; both config.json layouts (transformers 5.x
`rope_parameters`, 4.x top-level keys) with a non-default rope_theta and GLM-4.5's QK-norm.
Then the other way: a flashcp run exported with `flashcp export` and loaded by transformers,
also one trained from scratch with the byte tokenizer (`AutoModelForCausalLM` and
`AutoTokenizer` on the export directory as it is), and one with a multi-token-prediction layer
(which transformers ignores).

Marker `hf`: `bash scripts/test.sh hf` installs torch (a CPU wheel) and runs these; the default
CI run deselects them (docs/testing.md, "The tiers")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.checkpoint.export import export_run
from flashcp.config import Config
from flashcp.models import build_model
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.parallelize import default_model_factory
from helpers.configs import Sections, tiny_config
from helpers.trainruns import Fit

pytestmark = pytest.mark.hf


def _torch() -> Any:
    """`torch`, imported on first use (collecting this module never needs it; the default run
    deselects these tests), with a clear failure when the tier runs without it."""
    try:
        import torch
    except ImportError:
        pytest.fail("the hf tier needs torch: run `bash scripts/test.sh hf`, which installs it")
    return torch


def _transformers() -> Any:
    """transformers' model classes. paddlecodec installs a module named `torchcodec` without
    package metadata, which transformers' audio utilities trip over at import: tell it that
    torchcodec is absent (nothing here decodes audio)."""
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    def absent() -> bool:
        return False

    import_utils.is_torchcodec_available = absent
    utils.is_torchcodec_available = absent
    import transformers

    return transformers


TOL = 1e-4
"""float32 logits of O(1) after a few layers: HF and flashcp differ only by summation order."""
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    eos_token_id=[1, 2],
    rope_parameters={"rope_type": "default", "rope_theta": 2500.0, "partial_rotary_factor": 0.5},
)
MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.7,
    norm_topk_prob=True,
    attention_bias=True,
    use_qk_norm=True,
)
DOCS = [9, 14, 5, 12]  # one packed sequence of 40 tokens


def _hf_model(arch: str) -> Any:
    """A tiny random HF model, every tensor perturbed (norm weights, biases, the router's
    correction bias, QK-norm weights) so no part of the forward is an identity."""
    tf = _transformers()
    _torch().manual_seed(0 if arch == "glm" else 1)
    if arch == "glm":
        config = tf.Glm4Config(**COMMON, attn_implementation="eager")
        model = tf.Glm4ForCausalLM(config)
    else:
        config = tf.Glm4MoeConfig(**COMMON, **MOE, attn_implementation="eager")
        model = tf.Glm4MoeForCausalLM(config)
    return perturbed(model)


def perturbed(model: Any) -> Any:
    """`model` (torch) in eval mode with every weight drawn afresh: norms 1 + noise, matrices
    N(0, 0.1²), vectors N(0, 0.2²), so no layer is an identity (rotary buffers left alone)."""
    with _torch().no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("inv_freq"):
                continue
            noise = _torch().randn(tensor.shape) * (0.05 if tensor.ndim > 1 else 0.2)
            if name.endswith("norm.weight"):
                tensor.copy_(1.0 + noise)
            elif tensor.ndim > 1:
                tensor.copy_(noise * 2)
            else:
                tensor.copy_(noise)
    return model.eval()


def _as_4x(directory: Path) -> None:
    """Rewrite a transformers 5.x config.json in 4.x's layout (RoPE keys at the top level)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        rope_scaling=None,
        torch_dtype=config.pop("dtype", "float32"),
    )
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module", params=["glm", "glm_moe"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(directory), max_shard_size="100KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert "rope_parameters" in json.loads((directory / "config.json").read_text())
    return request.param, model, directory


def _hf_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    with _torch().no_grad():
        return model(_torch().tensor(ids)).logits.numpy()


HF: Sections = {"data": {"seq_len": 40, "tokenizer": "byte"}, "run": {"device": "cpu"}}


def _hf_cfg(directory: Path, **model: Any) -> Config:
    """The checkpoint in `directory` (`model` keys over it), 40-token rows, on the CPU."""
    return tiny_config(base=HF, model={"from_pretrained": str(directory), **model})


def _flashcp_logits(model: Any, ids: np.ndarray, mask: Any) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=mask.indices, causal=True)
    with paddle.no_grad():
        return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


def _close(got: np.ndarray, want: np.ndarray) -> float:
    err = float(np.abs(got - want).max())
    assert err <= TOL * max(1.0, float(np.abs(want).max())), err
    return err


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
def test_from_pretrained_matches_transformers(saved: tuple, layout: str, tmp_path: Path) -> None:
    arch, hf, directory = saved
    if layout == "4.x":
        copy = tmp_path / "old"
        copy.mkdir()
        for f in directory.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        _as_4x(copy)
        directory = copy
    cfg = _hf_cfg(directory)
    assert cfg.model.arch == arch and cfg.model.rotary_base == 2500.0
    assert cfg.model.use_qk_norm == (arch == "glm_moe")
    model = default_model_factory(cfg)
    ids = np.random.default_rng(3).integers(3, 320, (2, 40))
    want = _hf_logits(hf, ids)
    _close(_flashcp_logits(model, ids, masks.causal_mask(2, 40)), want)
    # negative control: the pre-fix reading of a 5.x file (rope_theta silently 10000)
    old = build_model(dataclasses.replace(cfg.model, rotary_base=10000.0), seed=0)
    load_hf_checkpoint(old, directory)
    err = np.abs(_flashcp_logits(old, ids, masks.causal_mask(2, 40)) - want).max()
    assert err > 100 * TOL


def test_packed_documents_match_each_document_alone(saved: tuple) -> None:
    arch, hf, directory = saved
    model = default_model_factory(_hf_cfg(directory))
    ids = np.random.default_rng(4).integers(3, 320, (1, sum(DOCS)))
    got = _flashcp_logits(model, ids, masks.causal_document_mask(DOCS, 1))
    start = 0
    for n in DOCS:
        _close(got[:, start : start + n], _hf_logits(hf, ids[:, start : start + n]))
        start += n
    # control: the same packed row under a plain causal mask attends across documents
    leaky = _flashcp_logits(model, ids, masks.causal_mask(1, sum(DOCS)))
    assert np.abs(leaky[:, DOCS[0] :] - got[:, DOCS[0] :]).max() > 100 * TOL


def test_transformers_loads_a_flashcp_export(saved: tuple, tmp_path: Path, fit: Fit) -> None:
    """Train one step from the HF directory, export, load with transformers: same logits."""
    arch, _, directory = saved
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
    cls = tf.Glm4ForCausalLM if arch == "glm" else tf.Glm4MoeForCausalLM
    hf = cls.from_pretrained(str(out), attn_implementation="eager").eval()
    assert hf.config.rope_parameters["rope_theta"] == 2500.0
    ids = np.random.default_rng(5).integers(3, 320, (2, 40))
    want = _flashcp_logits(trainer.model, ids, masks.causal_mask(2, 40))
    _close(_hf_logits(hf, ids), want)
    before = _hf_logits(_hf_model(arch), ids)  # control: the step changed the model
    assert np.abs(before - want).max() > 100 * TOL


def _scratch_config(tmp_path: Path, preset: str, **model: Any) -> Config:
    """One step from scratch with the byte tokenizer, a checkpoint to export, in `tmp_path/run`
    (`model` keys over the preset)."""
    raw = {
        "model": {"preset": preset, "max_seq_len": 64, **model},
        "data": {"seq_len": 32, "micro_batch_size": 2, "tokenizer": "byte"},
        "train": {"steps": 1, "lr": 1e-2, "warmup_steps": 0, "min_lr": 1e-3, "seed": 2},
        "checkpoint": {"every": 1},
        "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
    }
    return tiny_config(tmp_path, base=raw)


@pytest.mark.parametrize("preset", ["tiny_glm", "tiny_glm_moe"])
def test_transformers_loads_a_from_scratch_export(preset: str, tmp_path: Path, fit: Fit) -> None:
    """A run trained from scratch with the byte tokenizer (no starting config.json) exports
    to a directory transformers loads as it is: `AutoModelForCausalLM` with the run's token
    ids (not GLM's defaults, outside the 259-token vocabulary) and `AutoTokenizer` with the
    byte ids; the logits of the tokenizer's ids match the trained model's."""
    trainer = fit(_scratch_config(tmp_path, preset)).trainer
    out = tmp_path / "export"
    export_run(tmp_path / "run", out)
    tf = _transformers()
    hf = tf.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    tok = tf.AutoTokenizer.from_pretrained(str(out))
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (
        256, 257, 258
    )  # fmt: skip
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    text = ["Grüße, 世界! packed documents, GLM", "a second row of the same length.."]
    ids = np.asarray([[256, *tok(t, add_special_tokens=False)["input_ids"][:30]] for t in text])
    assert ids[0, 1:].tolist() == list(text[0].encode("utf-8"))[:30]
    want = _flashcp_logits(trainer.model, ids, masks.causal_mask(*ids.shape))
    _close(_hf_logits(hf, ids), want)
    # negative control: the config.json an export wrote before (no token ids): transformers
    # fills in its class defaults, GLM-4's pad 151329 (refused), GLM-4.5's None (no EOS)
    config = json.loads((out / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    if preset == "tiny_glm":
        with pytest.raises(Exception, match="(?i)padding_idx"):
            tf.AutoModelForCausalLM.from_pretrained(str(out))
    else:
        assert tf.AutoConfig.from_pretrained(str(out)).eos_token_id is None


@pytest.mark.parametrize("preset", ["tiny_glm", "tiny_glm_moe"])
def test_transformers_loads_an_export_with_mtp_layers(
    preset: str, tmp_path: Path, fit: Fit
) -> None:
    """An export with a (trained) multi-token-prediction layer still loads in transformers:
    ``Glm4ForCausalLM`` / ``Glm4MoeForCausalLM`` build no MTP layer, report its weights
    (``model.layers.{L}.*``, and nothing else) as unexpected and compute the main model's
    logits; the config keeps ``num_nextn_predict_layers`` for the serving engines."""
    trainer = fit(_scratch_config(tmp_path, preset, mtp_layers=1, mtp_loss_weight=0.5)).trainer
    out = tmp_path / "export"
    export_run(tmp_path / "run", out, max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = f"model.layers.{trainer.model.args.num_layers}."
    mtp_keys = {k for k in index if k.startswith(mtp)}
    assert f"{mtp}eh_proj.weight" in mtp_keys and f"{mtp}shared_head.head.weight" in mtp_keys
    tf = _transformers()
    hf, info = tf.AutoModelForCausalLM.from_pretrained(
        str(out), attn_implementation="eager", output_loading_info=True
    )
    hf.eval()
    assert hf.config.num_nextn_predict_layers == 1
    unexpected = set(info["unexpected_keys"])  # transformers 5 names fused experts its way
    assert all(k.startswith(mtp) for k in unexpected) and not info["missing_keys"]
    assert {k for k in mtp_keys if ".experts." not in k} <= unexpected
    ids = np.random.default_rng(6).integers(3, 256, (2, 32))
    want = _flashcp_logits(trainer.model, ids, masks.causal_mask(*ids.shape))
    _close(_hf_logits(hf, ids), want)
