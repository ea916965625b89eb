"""Sequence tiling (`model.tile_tokens`) and chunked attention (`attention.query_chunk` /
`attention.kv_chunk`) through the trainer, launched, against the plain run in one process.

* MoE + DPO + LoRA, PP = 2 × CP = 2 (4 processes): the combined recipe with full recompute,
  tiles of 48 tokens (not dividing the 128 local tokens) and chunked attention; the reference
  is the same config in one process, untiled and unchunked;
* EP = 2 × CP = 2: the MoE layers' all-to-all runs per tile (same tiles on both ep ranks);
  the router's integer loads and the training match the plain one-process run;
* GLM-4 dense, CP = 2, refined recompute, tiles and chunks.

Losses, gradient norms (and DPO rewards) and every gradient within the float32 rule of
`bench.numerics` (`trainruns.assert_training_matches`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from helpers.paths import ROOT
from helpers.trainruns import assert_training_matches, train_in_process, train_launched

pytestmark = [pytest.mark.integration, pytest.mark.equivalence]

STEPS = 2
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "debug.dump_grads=true"]
PLAIN = ["parallel.pp=1", "parallel.cp=1", "parallel.ep=1", "parallel.pp_layers=null"]
CHUNKS = ["attention.query_chunk=24", "attention.kv_chunk=32"]


def beta_of(config: Path) -> float | None:
    dpo = load_config(config).extras.get("dpo")
    return None if dpo is None else float(dpo.beta)


@pytest.mark.timeout(300)
def test_moe_dpo_lora_pp2_cp2_tiled_chunked(tmp_path: Path) -> None:
    config = ROOT / "configs" / "glm" / "tiny_moe_dpo_lora_pp2_cp2.yaml"
    ref = train_in_process(config, tmp_path / "ref", [*COMMON, *PLAIN])
    tiled = ["model.recompute=full", "model.tile_tokens=48", *CHUNKS]
    run = train_launched(config, tmp_path / "run", 4, [*COMMON, *tiled])
    assert_training_matches(run, ref, steps=STEPS, pp=2, beta=beta_of(config))


@pytest.mark.timeout(300)
def test_moe_ep2_cp2_tiled(tmp_path: Path) -> None:
    config = ROOT / "configs" / "glm" / "tiny_moe_ep2_cp2.yaml"
    balance = ["model.router_bias_update_rate=0.01"]
    ref = train_in_process(config, tmp_path / "ref", [*COMMON, *PLAIN, *balance])
    tiled = ["model.tile_tokens=40", *CHUNKS, *balance]
    run = train_launched(config, tmp_path / "run", 2, [*COMMON, *tiled])
    assert_training_matches(run, ref, steps=STEPS)
    for got, want in zip(read_metrics(run), read_metrics(ref), strict=True):
        assert got["moe/max_over_mean_max"] == want["moe/max_over_mean_max"]


@pytest.mark.timeout(300)
def test_glm_cp2_refined_tiled_chunked(tmp_path: Path) -> None:
    config = ROOT / "configs" / "glm" / "tiny_cp2.yaml"
    ref = train_in_process(config, tmp_path / "ref", [*COMMON, *PLAIN])
    tiled = ["model.recompute=refined", "model.tile_tokens=20", *CHUNKS]
    run = train_launched(config, tmp_path / "run", 2, [*COMMON, *tiled])
    assert_training_matches(run, ref, steps=STEPS)
