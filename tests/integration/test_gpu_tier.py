"""The gpu tier's multi-process tests (issue 13 point 8); each skips with a reason without GPUs.

* 2-GPU CP parity with the real kernels over NCCL (`workers/gpu_cp_worker.py`): every rank's
  bf16 output and gradients against the float32 CPU reference at its positions, a wrong shard
  rejected, two deterministic runs bitwise equal.
* Every shipped tiny config as a real `flashcp train` job on GPUs: `train.dtype: auto` makes it
  bfloat16 there, and its losses at steps 1, 2 and 4 must be within `BF16_LOSS_RTOL` (2 %,
  absolute below a loss of 1; see `helpers.gpu`) of the float32 CPU goldens in
  `tests/golden/losses.json`, and fall from step 1 to step 4.
* Determinism: the same config twice with FLAGS_cudnn_deterministic on gives bitwise-equal
  metrics (losses and gradient norms).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import jobs
from flashcp.attention.registry import MODES
from flashcp.metrics.writer import read_metrics
from helpers.gpu import BF16_LOSS_RTOL, SKIP_NO_GPU, gpu_count
from helpers.launch import run_launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason=SKIP_NO_GPU)]

WORKER = Path(__file__).resolve().parent / "workers" / "gpu_cp_worker.py"
DETERMINISTIC = {"FLAGS_cudnn_deterministic": "1", "FLAGS_embedding_deterministic": "1"}


def _need(n: int) -> None:
    if gpu_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, this machine has {gpu_count()}")


@pytest.mark.timeout(600)
def test_two_gpu_cp_parity_with_real_kernels(tmp_path: Path) -> None:
    _need(2)
    result = run_launch(WORKER, 2, ["--out", str(tmp_path)], timeout=560, env=DETERMINISTIC)
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world"] == 2 and report["dtype"] == "bfloat16"
        assert report["device"].startswith("gpu"), report["device"]
        assert {c["mode"] for c in report["cases"]} == set(MODES)
        for case in report["cases"]:
            assert all(case["ok"].values()), case
            assert case["wrong_shard_rejected"], case
        assert report["bitwise"], f"rank {rank}: two deterministic runs differ"


CONFIGS = jobs.discover_configs()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_job_matches_float32_golden(config: str, tmp_path: Path) -> None:
    nproc = jobs.world_size(config)
    _need(nproc)
    run = jobs.run_flashcp(config, jobs.golden_overrides(), tmp_path / "run", timeout=540)
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert "gpu bfloat16" in run.log(0), "the job did not train in bf16 on the GPU"
    want = jobs.load_golden()["jobs"].get(config)
    problems = jobs.compare_losses(config, want, jobs.golden_entry(run), tol=BF16_LOSS_RTOL)
    assert not problems, "\n".join(problems)
    losses = run.losses()
    assert losses[jobs.GOLDEN_STEPS] < losses[1], losses


@pytest.mark.timeout(600)
def test_deterministic_gpu_runs_are_bitwise_equal(tmp_path: Path) -> None:
    config = "configs/gpt/tiny_cp2.yaml"
    _need(jobs.world_size(config))
    records = []
    for name in ("first", "second"):
        run = jobs.run_flashcp(config, jobs.golden_overrides(), tmp_path / name, timeout=540,
                               env=DETERMINISTIC)  # fmt: skip
        assert jobs.hygiene_problems(run) == [], run.summary()
        records.append([(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run.out_dir)])
    assert len(records[0]) == jobs.GOLDEN_STEPS
    assert records[0] == records[1], f"deterministic GPU runs differ: {records}"
