"""Issue 23's done-when for the MTP layer's way in and out: a GLM-4.5-shaped HF directory with a
multi-token-prediction layer (``num_nextn_predict_layers: 1``, written by hand under the HF
names) → `model.from_pretrained` (+ its `checkpoint.init_from`) → 2 training steps →
`flashcp export`. Carried frozen (``model.mtp_loss_weight: 0``) the export holds the SAME MTP
tensors, bit for bit, and says ``num_nextn_predict_layers: 1``, while the main model's tensors
moved; trained (weight > 0) the MTP tensors move too; a LoRA run's merged export passes the
frozen MTP base through unchanged (adapters on a frozen MTP layer are never merged). GPT and
GLM-4 models trained from scratch with MTP layers round-trip through their export."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from flashcp.checkpoint.export import export_run
from flashcp.checkpoint.merge_export import merged_specs
from flashcp.config import build_config
from flashcp.lora.model import apply_lora, lora_layers
from flashcp.models import ModelArgs, build_model
from flashcp.models.hf_state import hf_state_map
from flashcp.models.init import InitRule, fill_parameter
from flashcp.parallelize import default_model_factory
from helpers.configs import Sections, tiny_config
from helpers.hf_glm45 import hf_config_json, random_checkpoint, write_checkpoint
from helpers.trainruns import fit

ARGS = ModelArgs(
    arch="glm_moe", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, intermediate_size=48, max_seq_len=64, qkv_bias=False, use_qk_norm=True,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
    first_k_dense_replace=1, rotary_base=10_000.0, mtp_layers=1,
).check()  # fmt: skip
MTP = f"model.layers.{ARGS.num_layers}."
RUN: Sections = {
    "data": {"seq_len": 32, "micro_batch_size": 2, "tokenizer": "byte"},
    "train": {"steps": 2, "lr": 1e-2, "warmup_steps": 0, "min_lr": 1e-3, "seed": 3},
    "checkpoint": {"every": 2},
    "run": {"device": "cpu"},
}
"""Two steps on the CPU, checkpointed at the end: a run to export."""


def _glm45(tmp: Path, dtype: str = "float32") -> tuple[Path, dict[str, np.ndarray]]:
    """A GLM-4.5-shaped directory in `dtype` and its tensors (HF names and layout)."""
    weights = random_checkpoint(ARGS, seed=11, dtype=dtype)
    config = hf_config_json(ARGS, eos_token_id=257, pad_token_id=258, dtype=dtype)
    return write_checkpoint(tmp, weights, config=config), weights


@pytest.fixture(scope="module")
def glm45(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The float32 GLM-4.5-shaped directory and its tensors."""
    return _glm45(tmp_path_factory.mktemp("glm45"))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _exported(out: Path) -> dict[str, np.ndarray]:
    """Every tensor of an export, by key (through its index)."""
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name in sorted(set(index.values())):
        with safe_open(str(out / name), "numpy") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert tensors.keys() == index.keys()
    return tensors


def _train_and_export(
    tmp: Path, base: Path, model: dict[str, Any], **sections: Any
) -> tuple[dict[str, np.ndarray], dict[str, Any], list[dict[str, Any]]]:
    """(exported tensors, exported config.json, metrics rows) of a 2-step run from `base`."""
    cfg = tiny_config(tmp, base=RUN, model={"from_pretrained": str(base), **model}, **sections)
    assert cfg.model.mtp_layers == 1 and cfg.checkpoint.init_from == str(base)
    fitted = fit(cfg)
    out = tmp / "export"
    lora = "lora" in sections
    report = export_run(tmp / "run", out, merge_lora=lora, max_shard_bytes=100_000)
    assert len(report.shards) > 1  # streamed: the MTP layer goes with the last shard
    return _exported(out), json.loads((out / "config.json").read_text()), fitted.records


def _changed(exported: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> set[str]:
    return {k for k in weights if not _same(exported[k], weights[k])}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frozen_mtp_layer_is_exported_bitwise(tmp_path: Path, dtype: str) -> None:
    """In the file's dtype: float32, or GLM-4.5's own bf16 trained in bf16 storage."""
    base, weights = _glm45(tmp_path / "glm45", dtype)
    exported, config, records = _train_and_export(
        tmp_path, base, {"mtp_loss_weight": 0.0}, train={"param_dtype": dtype}
    )
    assert exported.keys() == weights.keys()  # every MTP key under its HF name, nothing else
    mtp = sorted(k for k in weights if k.startswith(MTP))
    assert len(mtp) == 6 + 8 + 2 + 3 * 5  # its parts, attention + norms, router, 4+1 experts
    assert str(weights[f"{MTP}eh_proj.weight"].dtype) == dtype
    for key in mtp:
        assert _same(exported[key], weights[key]), key
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    changed = _changed(exported, weights)  # not vacuous: training moved the main model
    assert not changed & set(mtp)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate.weight",
            "lm_head.weight", "model.embed_tokens.weight"} <= changed  # fmt: skip
    assert all("mtp_loss" not in r for r in records)  # never run


def test_trained_mtp_layer_moves_and_is_exported(glm45, tmp_path: Path) -> None:
    base, weights = glm45
    exported, config, records = _train_and_export(tmp_path, base, {"mtp_loss_weight": 0.5})
    assert exported.keys() == weights.keys() and config["num_nextn_predict_layers"] == 1
    changed = _changed(exported, weights)
    for part in ("eh_proj", "enorm", "hnorm", "shared_head.head", "shared_head.norm",
                 "embed_tokens", "self_attn.q_proj", "mlp.shared_experts.down_proj"):  # fmt: skip
        assert f"{MTP}{part}.weight" in changed, part
    assert all(np.isfinite(r["mtp_loss"]) for r in records) and len(records) == 2


LORA = {"rank": 4, "alpha": 8.0, "target_modules": [".*q_proj", ".*o_proj", ".*down_proj"]}


def test_lora_merged_export_passes_the_frozen_mtp_base_through(glm45, tmp_path: Path) -> None:
    """The adapters match the MTP block's projections too; frozen (weight 0) they are neither
    trained nor saved, and the export writes the MTP layer's base unchanged."""
    base, weights = glm45
    exported, config, _ = _train_and_export(
        tmp_path, base, {"mtp_loss_weight": 0.0}, run={"recipe": "sft"}, lora=LORA
    )
    assert exported.keys() == weights.keys() and config["num_nextn_predict_layers"] == 1
    changed = _changed(exported, weights)
    assert not {k for k in changed if k.startswith(MTP)}
    assert "model.layers.0.self_attn.q_proj.weight" in changed  # merged adapters: moved
    assert "model.layers.0.self_attn.k_proj.weight" not in changed  # not adapted


@pytest.mark.parametrize("weight", [0.0, 0.5], ids=["frozen", "trained"])
def test_merged_specs_never_merge_a_frozen_mtp_layer(weight: float) -> None:
    """With every adapter's B away from zero (so a merge shows): frozen MTP layers write
    their base weights as they are, every other adapted weight (and a trained MTP layer's)
    is merged."""
    args = dataclasses.replace(ARGS, vocab_size=64, mtp_loss_weight=weight)
    model = build_model(args, seed=1)
    targets = [".*q_proj", ".*down_proj", r".*mlp\.experts"]
    apply_lora(model, rank=2, alpha=4, target_modules=targets, seed=7)
    for name, layer in lora_layers(model):
        for sub, p in layer.named_parameters():
            if sub.endswith("lora_B"):
                fill_parameter(p, 9, f"{name}.{sub}", InitRule("normal", 0.05))
    base = {k: e.hf_array() for k, e in hf_state_map(model).items() if "lora" not in k}
    merged = {s.key: s.produce() for s in merged_specs(model)}
    assert merged.keys() == base.keys()
    adapted = {k for k in base if re.search(r"(q_proj|down_proj|experts\.\d+\.\w+)\.weight$", k)}
    assert {k for k in adapted if k.startswith(MTP)} >= {
        f"{MTP}self_attn.q_proj.weight", f"{MTP}mlp.experts.3.down_proj.weight"
    }
    for key in adapted:
        same = np.array_equal(merged[key], base[key])
        assert same == (key.startswith(MTP) and not weight), key
    for key in base.keys() - adapted:
        np.testing.assert_array_equal(merged[key], base[key], err_msg=key)


@pytest.mark.parametrize("arch", ["gpt", "glm"])
def test_from_scratch_mtp_model_round_trips_through_its_export(arch: str, tmp_path: Path) -> None:
    """GPT / GLM-4 trained from scratch with `model.mtp_layers: 1`: the export's config.json
    declares the layer (GLM-4: ``num_nextn_predict_layers``, which transformers' Glm4Config
    keeps as an extra attribute; GPT: in its flashcp args) and `model.from_pretrained` of it
    builds the same model with the trained tensors, bit for bit."""
    preset = "tiny" if arch == "gpt" else "tiny_glm"
    model = {"preset": preset, "max_seq_len": 64, "mtp_layers": 1, "mtp_loss_weight": 0.5}
    trainer = fit(tiny_config(tmp_path, base=RUN, model=model, train={"steps": 1},
                              checkpoint={"every": 1})).trainer  # fmt: skip
    out = tmp_path / "export"
    export_run(tmp_path / "run", out)
    config = json.loads((out / "config.json").read_text())
    if arch == "glm":
        assert config["num_nextn_predict_layers"] == 1
    else:
        assert config["flashcp_model_args"]["mtp_layers"] == 1
    raw = {"model": {"from_pretrained": str(out)}, "data": {"seq_len": 32, "tokenizer": "byte"}}
    reloaded = default_model_factory(build_config(raw))
    assert reloaded.args.mtp_layers == 1 and len(reloaded.mtp_layers()) == 1
    trained = trainer.model.state_dict()
    assert reloaded.state_dict().keys() == trained.keys()
    assert any(k.startswith("model.layers.2.eh_proj") for k in trained)
    for name, t in reloaded.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), trained[name].numpy(), err_msg=name)
