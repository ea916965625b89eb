"""`configs/glm/tiny_moe_bf16_zero_ep2_cp2.yaml`: the GLM recipes' production path at tiny size
(issue 21 item 1) — bf16 storage with float32 masters, ZeRO-1, expert parallelism 2 over
context parallelism 2 — is a shipped tiny config, so the CPU golden suite
(`tests/integration/test_jobs.py`) and the GPU tier (`tests/integration/test_gpu_tier.py`),
which both run `jobs.discover_configs()`, train it; its golden entry was written by
`scripts/update_golden.py`."""

from __future__ import annotations

import paddle

from bench import jobs
from flashcp.config import load_config
from flashcp.models import build_model
from flashcp.plan import plan
from helpers.paths import ROOT

CONFIG = "configs/glm/tiny_moe_bf16_zero_ep2_cp2.yaml"


def test_it_is_the_production_path() -> None:
    cfg = load_config(ROOT / CONFIG)
    p, t = cfg.parallel, cfg.train
    assert (t.param_dtype, t.dtype) == ("bfloat16", "auto")  # bf16 on GPU, float32 on CPU
    assert p.shard_optimizer and (p.dp, p.pp, p.cp, p.ep) == (1, 1, 2, 2)
    assert cfg.model.num_experts and cfg.model.num_experts % p.ep == 0
    # the shipped recipes it stands for share those settings
    for name in ("glm45_air_cp8.yaml", "glm45_air_sft_ep8_pp4_cp8.yaml"):
        big = load_config(ROOT / "configs" / "glm" / name, allow_placeholders=True)
        assert big.train.param_dtype == "bfloat16" and big.parallel.shard_optimizer, name
    # negative control: the other tiny MoE configs store float32 and do not shard
    other = load_config(ROOT / "configs/glm/tiny_moe_ep2_cp2.yaml")
    assert other.train.param_dtype == "float32" and not other.parallel.shard_optimizer


def test_it_is_in_the_gpu_tier_and_the_cpu_golden_suite() -> None:
    assert CONFIG in jobs.discover_configs()  # both suites parametrize over this list
    entry = jobs.load_golden()["jobs"][CONFIG]
    assert entry["nproc"] == 2 and entry["overrides"] == jobs.golden_overrides()
    losses = {int(s): v for s, v in entry["losses"].items()}
    assert sorted(losses) == list(jobs.CHECK_STEPS) and losses[4] < losses[1]


def test_parameters_are_stored_in_bf16_and_the_plan_shards_masters() -> None:
    cfg = load_config(ROOT / CONFIG)
    model = build_model(cfg.model, param_dtype=cfg.train.param_dtype, seed=0)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {paddle.bfloat16}, dtypes
    rank = plan(cfg, device="gpu").peak
    assert rank.items["main_grads"] > 0 and rank.items["master_weights"] > 0
    # ZeRO-1 halves the masters against the unsharded layout (2 ranks, the experts over edp 1)
    unsharded = load_config(ROOT / CONFIG, ["parallel.shard_optimizer=false"])
    whole = plan(unsharded, device="gpu").peak
    assert rank.items["master_weights"] < whole.items["master_weights"]
