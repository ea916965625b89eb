"""GPU tier: the production head_dim and the non-deterministic kernels (issue 21 item 10).

Skipped without GPUs (marked `gpu`; `scripts/gpu_check.sh` runs it). The tiny configs have
head_dim 16; the shipped GLM recipes have 128, where the FlashAttention kernels pick other tile
shapes and the deterministic FA3 rules differ (`flashcp.fa_dispatch`). And the golden jobs run
with `train.deterministic: true`, so the kernels of a run without it (FA3's non-deterministic
backward on SM90) are exercised only here:

* head_dim 128: the dense GLM and the MoE config (model.head_dim=128) as real bf16
  `flashcp train` jobs on GPUs against the same config trained in float32 on the CPU in this
  process (cp = ep = 1: the layouts train alike, `tests/integration/test_train_multiproc.py`),
  within `BF16_LOSS_RTOL`, and training (the loss falls from step 1 to step 4).
* The EP + CP MoE config (the GLM-4.5 path) with `train.deterministic=false` and the flags
  unset, against the float32 CPU goldens within `BF16_LOSS_RTOL`.
"""

from __future__ import annotations

import io
from pathlib import Path

import paddle
import pytest

from bench import jobs
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.gpu import BF16_LOSS_RTOL, SKIP_NO_GPU, gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason=SKIP_NO_GPU)]

HEAD_DIM_128 = ["model.head_dim=128"]
NON_DETERMINISTIC = {"FLAGS_cudnn_deterministic": "0", "FLAGS_embedding_deterministic": "0"}


def _need(n: int) -> None:
    if gpu_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, this machine has {gpu_count()}")


def _far(got: dict[int, float], want: dict[int, float]) -> list[str]:
    """Steps where a bf16 loss misses the float32 one by more than `BF16_LOSS_RTOL`."""
    return [
        f"step {s}: bf16 {got[s]:.5f} vs float32 {w:.5f}"
        for s, w in want.items()
        if abs(got[s] - w) > BF16_LOSS_RTOL * max(1.0, abs(w))
    ]


def _cpu_losses(config: str, overrides: list[str], out: Path) -> dict[int, float]:
    """The config trained here in float32 on the CPU, in one process (cp = ep = 1)."""
    before = paddle.get_device()
    cfg = load_config(jobs.ROOT / config, [*overrides, "parallel.cp=1", "parallel.ep=1",
                                           "run.device=cpu", f"run.output_dir={out}"])  # fmt: skip
    try:
        Trainer(cfg, stream=io.StringIO()).fit()
    finally:
        paddle.set_device(before)
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(out)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", ["configs/glm/tiny_cp2.yaml", "configs/glm/tiny_moe_cp2.yaml"])
def test_head_dim_128_bf16_job_matches_cpu_float32(config: str, tmp_path: Path) -> None:
    _need(jobs.world_size(config))
    overrides = [*jobs.golden_overrides(), *HEAD_DIM_128]
    run = jobs.run_flashcp(config, overrides, tmp_path / "gpu", timeout=540)
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert "gpu bfloat16" in run.log(0), "the job did not train in bf16 on the GPU"
    got = {int(r["step"]): float(r["loss"]) for r in read_metrics(run.out_dir)}
    want = _cpu_losses(config, overrides, tmp_path / "cpu")
    checked = {s: want[s] for s in jobs.CHECK_STEPS}
    assert not _far(got, checked), _far(got, checked)
    assert got[jobs.GOLDEN_STEPS] < got[1], got


@pytest.mark.timeout(600)
def test_moe_ep_job_without_deterministic_flags_matches_golden(tmp_path: Path) -> None:
    config = "configs/glm/tiny_moe_ep2_cp2.yaml"
    _need(jobs.world_size(config))
    overrides = [*jobs.golden_overrides(), "train.deterministic=false"]
    run = jobs.run_flashcp(config, overrides, tmp_path / "run", timeout=540, env=NON_DETERMINISTIC)
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert "gpu bfloat16" in run.log(0), "the job did not train in bf16 on the GPU"
    golden = jobs.load_golden()["jobs"][config]["losses"]
    want = {int(s): float(v) for s, v in golden.items()}
    got = {int(r["step"]): float(r["loss"]) for r in read_metrics(run.out_dir)}
    assert not _far(got, want), _far(got, want)
    assert got[jobs.GOLDEN_STEPS] < got[1], got
