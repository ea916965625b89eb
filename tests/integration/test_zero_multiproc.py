"""ZeRO-1 (`parallel.shard_optimizer`) in launched gloo jobs: the same losses as unsharded, and
checkpoints that move between dp × cp layouts and between sharded and unsharded.

Runs (tiny GPT, 20 steps of 2 sequences of 64 tokens; the 4-rank runs in ONE launched job and
the 2-rank runs in another, `workers/zero_worker.py`, to keep start-up cost down):

* one process, sharded (degree 1), checkpoint at step 10 — in this process;
* 4 ranks: DP=2×CP=2 unsharded and sharded (checkpoints at 10), PP=2×CP=2 (tied embeddings)
  unsharded and sharded, the sharded DP×CP run resumed from its own step 10, from the
  unsharded run's step 10, and from the one-process checkpoint; bf16 storage (`bf16toy`)
  unsharded and sharded;
* 2 ranks: CP=2 unsharded and sharded; the DP×CP sharded step-10 checkpoint resumed at CP=2,
  sharded and unsharded; a bf16 tied matrix's float32 `main_grad` summed over pp = 2 stages;
* one process: the DP×CP sharded step-10 checkpoint resumed here.

Tolerances. Sharded vs unsharded in the same layout: the gradients are reduce-scattered over
cp, then dp, adding the ranks' float32 contributions in the same order as the unsharded
all-reduce (bitwise equal sums with 2-rank groups), and AdamW is elementwise, so the only
difference is the clipping norm (`flashcp.optim.clip`: a parameter split between shards gets
the float32 sum of its pieces' squares instead of one square of the whole tensor, a few float32
ulps in the clip factor); the issue's relative 1e-6 over 20 steps is then ~30× above what is
measured (≤ 4e-8 for DP×CP; PP×CP, CP and bf16 measured bitwise). Resuming in the layout that wrote
the checkpoint is bitwise. Resuming in another layout continues the same model state, but that
layout sums its gradients in another order from step 11 on, so it is compared with an
uninterrupted run of the SAME layout as the resumed one (the checkpoint's state equals it up to
the first 10 steps' rounding): relative `CROSS`, the issue's 1e-6 as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.launch import run_launch
from helpers.paths import ROOT

pytestmark = pytest.mark.integration

GPT = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"
WORKER = Path(__file__).resolve().parent / "workers" / "zero_worker.py"
STEPS = 20
BASE = [
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "data.seq_len=64",
    "model.max_seq_len=64",
    "checkpoint.every=0",
    "checkpoint.keep_last=5",
]
ZERO = ["parallel.shard_optimizer=true"]
CKPT = ["checkpoint.every=10"]
ONE = ["parallel.cp=1", "data.micro_batch_size=2"]
CP2 = ["parallel.cp=2", "data.micro_batch_size=2"]
DP2CP2 = ["parallel.dp=2", "parallel.cp=2", "data.micro_batch_size=1"]
PP2CP2 = ["parallel.pp=2", "parallel.cp=2", "data.micro_batch_size=1", "train.grad_accum=2",
          "model.tie_embeddings=true"]  # fmt: skip
SAME = 1e-6
"""Relative loss tolerance, sharded vs unsharded, same layout (the issue's bound)."""
CROSS = 1e-6
"""Relative loss tolerance of a run resumed in another layout (see the module docstring;
measured here ≤ 1.5e-7: the layouts' own summation orders differ by that much)."""


def losses(run: Path) -> np.ndarray:
    return np.array([float(r["loss"]) for r in read_metrics(run)])


def rel(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def in_process(out: Path, overrides: list[str]) -> Path:
    cfg = load_config(GPT, [*BASE, *overrides, f"run.output_dir={out}"])
    Trainer(cfg).fit()
    return out


def launch_plan(
    tmp: Path, nproc: int, runs: dict[str, tuple[list[str], bool]], extra: list[dict] | None = None
) -> dict[str, Path]:
    """Launch one job of `nproc` ranks running `runs` (name -> (overrides, toy)) in order,
    then the `extra` worker entries."""
    out = {name: tmp / name for name in runs}
    plan: list[dict] = [
        {"config": str(GPT), "toy": toy,
         "overrides": [*BASE, *overrides, f"run.output_dir={out[name]}"]}
        for name, (overrides, toy) in runs.items()
    ]  # fmt: skip
    plan += extra or []
    (tmp / "plan.json").write_text(json.dumps(plan, indent=1))
    result = run_launch(
        WORKER, nproc, ["--plan", str(tmp / "plan.json")], timeout=420, log_dir=tmp / "logs"
    )
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    return out


def step10(run: Path) -> str:
    return f"checkpoint.resume={run / 'checkpoints' / 'step_10'}"


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return in_process(tmp_path_factory.mktemp("one") / "run", [*ONE, *ZERO, *CKPT])


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, one: Path) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("four")
    dp_zero = tmp / "dp_zero"
    dp_plain = tmp / "dp_plain"
    runs = {
        "dp_plain": ([*DP2CP2, *CKPT], False),
        "dp_zero": ([*DP2CP2, *ZERO, *CKPT], False),
        "dp_zero_resumed": ([*DP2CP2, *ZERO, step10(dp_zero)], False),
        "dp_zero_from_plain": ([*DP2CP2, *ZERO, step10(dp_plain)], False),
        "dp_zero_from_one": ([*DP2CP2, *ZERO, step10(one)], False),
        "pp_plain": (PP2CP2, False),
        "pp_zero": ([*PP2CP2, *ZERO], False),
        "bf16_plain": (DP2CP2, True),
        "bf16_zero": ([*DP2CP2, *ZERO], True),
    }
    return launch_plan(tmp, 4, runs)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, four: dict[str, Path]) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("two")
    runs = {
        "cp_plain": (CP2, False),
        "cp_zero": ([*CP2, *ZERO], False),
        "cp_zero_from_dp": ([*CP2, *ZERO, step10(four["dp_zero"])], False),
        "cp_plain_from_dp": ([*CP2, step10(four["dp_zero"])], False),
    }
    (tmp / "tied").mkdir()
    out = launch_plan(tmp, 2, runs, [{"check": "tied_main_grad", "out": str(tmp / "tied")}])
    out["tied"] = tmp / "tied"
    return out


@pytest.mark.timeout(600)
def test_sharded_equals_unsharded_over_20_steps(four: dict[str, Path], two: dict[str, Path]):
    report = {}
    for plain, zero in (("dp_plain", "dp_zero"), ("pp_plain", "pp_zero"),
                        ("bf16_plain", "bf16_zero")):  # fmt: skip
        a, b = losses(four[zero]), losses(four[plain])
        assert len(a) == STEPS and np.isfinite(a).all()
        report[zero] = rel(a, b)
    report["cp_zero"] = rel(losses(two["cp_zero"]), losses(two["cp_plain"]))
    print("relative loss difference, sharded vs unsharded:", report)
    assert all(v <= SAME for v in report.values()), report
    # the runs learn (a broken update would still be 'equal' if both paths broke alike)
    for run in (four["dp_plain"], four["pp_plain"], two["cp_plain"], four["bf16_plain"]):
        ls = losses(run)
        assert ls[-3:].mean() < ls[:3].mean() - 0.5, run
    # negative control: the bf16 toy and the tiny GPT are different models
    assert rel(losses(four["bf16_zero"]), losses(four["dp_zero"])) > 1e-2
    # each rank of DP×CP wrote its own shard; the describe line says how many ranks share
    ck = four["dp_zero"] / "checkpoints" / "step_20"
    shards = sorted(p.name for p in ck.glob("optimizer-*.shard-*.safetensors"))
    assert shards == [f"optimizer-00001-of-00001.shard-0000{i}-of-00004.safetensors"
                      for i in (1, 2, 3, 4)]  # fmt: skip
    log = (four["dp_zero"].parent / "logs" / "workerlog.0").read_text()
    assert "ZeRO-1 sharded over dp × cp = 4 ranks" in log


@pytest.mark.timeout(600)
def test_resume_across_layouts_and_sharding(
    tmp_path: Path, one: Path, four: dict[str, Path], two: dict[str, Path]
) -> None:
    dp_zero, dp_plain = losses(four["dp_zero"]), losses(four["dp_plain"])
    # same layout, same mode: bitwise
    np.testing.assert_array_equal(losses(four["dp_zero_resumed"]), dp_zero[10:])
    # unsharded → sharded, same layout
    assert rel(losses(four["dp_zero_from_plain"]), dp_plain[10:]) <= SAME
    # 1 process → 4 ranks, and 4 ranks → 2 ranks (sharded and unsharded) and → 1 process
    single = in_process(tmp_path / "one_from_dp", [*ONE, *ZERO, step10(four["dp_zero"])])
    cross = {
        "1→DP2×CP2": rel(losses(four["dp_zero_from_one"]), dp_zero[10:]),
        "DP2×CP2→CP2": rel(losses(two["cp_zero_from_dp"]), losses(two["cp_zero"])[10:]),
        "DP2×CP2→CP2 unsharded": rel(losses(two["cp_plain_from_dp"]),
                                     losses(two["cp_plain"])[10:]),  # fmt: skip
        "DP2×CP2→1": rel(losses(single), losses(one)[10:]),
    }
    print("relative loss difference after a resume in another layout:", cross)
    assert all(v <= CROSS for v in cross.values()), cross
    # negative control: resuming from the wrong step is far outside the tolerance
    assert rel(losses(four["dp_zero_from_one"]), dp_zero[:10]) > 100 * CROSS


@pytest.mark.timeout(600)
def test_tied_matrix_sums_float32_main_grads_across_stages(two: dict[str, Path]) -> None:
    """bf16 tied embedding under pp = 2: `sync_tied_gradients` adds the stages' float32
    `main_grad`s (2.5 + 1.5 each element per step; a stage without one counts zeros)."""
    ranks = [json.loads((two["tied"] / f"rank{r}.json").read_text()) for r in (0, 1)]
    for both, first_only in ranks:
        assert both["dtype"] == first_only["dtype"] == "paddle.float32"
        assert both["grad_is_none"] and first_only["grad_is_none"]
        np.testing.assert_array_equal(both["main_grad"], np.full([3, 2], 4.0))
        np.testing.assert_array_equal(first_only["main_grad"], np.full([3, 2], 1.5))
