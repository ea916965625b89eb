"""A GLM-4.5 MTP layer through a launched PP = 2 × CP = 2 × EP = 2 run (4 gloo processes).

A GLM-4.5-shaped HF directory with a multi-token-prediction layer (``num_nextn_predict_layers:
1``, written by hand under the HF names: `helpers.hf_glm45`) is the run's
`model.from_pretrained`: each stage reads only its tensors — the last stage the MTP layer, each
ep rank only its share of the MTP layer's routed experts — and the checkpoint gathers them
whole. Two steps with the MTP layer carried frozen (``model.mtp_loss_weight: 0``), then
`flashcp export`: every ``model.layers.{L}.*`` tensor is the directory's, bit for bit, and
config.json says ``num_nextn_predict_layers: 1``, while the main model's tensors moved (the
in-process test of the same flow is `tests/unit/checkpoint/test_export_mtp.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from flashcp.checkpoint.export import export_run
from flashcp.models import ModelArgs
from helpers.hf_glm45 import hf_config_json, random_checkpoint, write_checkpoint
from helpers.trainruns import merged_tensors, train_launched

pytestmark = pytest.mark.integration

ARGS = ModelArgs(
    arch="glm_moe", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, intermediate_size=48, max_seq_len=64, use_qk_norm=True, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
    first_k_dense_replace=0, mtp_layers=1,
).check()  # fmt: skip
MTP = f"model.layers.{ARGS.num_layers}."


@pytest.mark.timeout(300)
def test_pp2_cp2_ep2_run_exports_the_frozen_mtp_layer_bitwise(tmp_path: Path) -> None:
    weights = random_checkpoint(ARGS, seed=21)
    base = write_checkpoint(tmp_path / "glm45", weights, shards=3, config=hf_config_json(ARGS))
    config = {
        "model": {"from_pretrained": str(base), "mtp_loss_weight": 0.0},
        "parallel": {"pp": 2, "cp": 2, "ep": 2, "cp_mode": "contiguous_allgather"},
        "data": {"seq_len": 64, "micro_batch_size": 1, "tokenizer": "byte"},
        "train": {"steps": 2, "grad_accum": 2, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0,
                  "seed": 0},  # fmt: skip
        "checkpoint": {"every": 2},
        "run": {"device": "cpu"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run = train_launched(path, tmp_path / "run", 4, [])
    export_run(run, tmp_path / "export")
    exported = merged_tensors(tmp_path / "export")
    assert exported.keys() == weights.keys()
    mtp = sorted(k for k in weights if k.startswith(MTP))
    assert f"{MTP}mlp.experts.3.down_proj.weight" in mtp  # both ep ranks' experts, gathered
    for key in mtp:
        np.testing.assert_array_equal(exported[key], weights[key], err_msg=key)
    assert json.loads((tmp_path / "export" / "config.json").read_text())[
        "num_nextn_predict_layers"
    ] == 1
    moved = {k for k in weights if not np.array_equal(exported[k], weights[k])}
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.experts.3.up_proj.weight", "lm_head.weight"):  # fmt: skip
        assert key in moved, key
