"""The production path saves and resumes in ANOTHER dp × cp layout (issue 21 item 1):
`configs/glm/tiny_moe_bf16_zero_ep2_cp2.yaml` (bf16 storage, float32 masters sharded by
ZeRO-1, ep 2 over cp 2) trains 4 steps with a checkpoint at step 2; the step-2 checkpoint
resumes as dp 2 × cp 1 (ep 2 over dp 2: each rank still holds half of the experts, but the
optimizer shards and the expert-parallel group are other ranks' now) and trains steps 3-4.

Step 3's loss comes from the parameters the checkpoint holds (bf16, cast from the float32
masters); step 4's also from the AdamW moments and masters restored into the new shards. The
resumed run sums in another order than the uninterrupted one from step 3 on, so the losses are
compared with the float32 rule of `tests/numerics.py` on CPU (`BF16_LOSS_RTOL` for a bf16 run
on GPUs, the gpu tier's twin). The gradient norms also differ by bf16 rounding: a bf16-stored
weight's gradient is rounded to bf16 once per rank and micro-batch before the float32
`main_grad` sums it, and the layouts split the tokens differently (dp 2 × one sequence each vs
cp 2 × half of both), so each element's sum carries other roundings, |δ| <= 2⁻⁹·|g| each,
which move the norm by at most `BF16_GRAD_RTOL` = 2⁻⁹ of it (measured here: 7.5e-5 relative).
Negative controls: the uninterrupted run's step 2 misses step 3 by far under both rules, so
each comparison sees one optimizer step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import jobs, numerics
from flashcp.metrics.writer import read_metrics
from helpers.gpu import BF16_LOSS_RTOL, SKIP_NO_GPU, gpu_count

CONFIG = "configs/glm/tiny_moe_bf16_zero_ep2_cp2.yaml"
RUN = ["train.steps=4", "train.deterministic=true", "checkpoint.every=2", "checkpoint.keep_last=3"]
OTHER_LAYOUT = ["parallel.dp=2", "parallel.cp=1", "data.micro_batch_size=1"]
"""dp 2 × micro-batch 1 sees the sequences of dp 1 × micro-batch 2."""
BF16_GRAD_RTOL = 2.0**-9
"""The gradient norm of bf16-stored weights across layouts (module docstring)."""


def _rows(run: Path) -> dict[int, dict]:
    return {int(r["step"]): r for r in read_metrics(run)}


def save_and_resume_elsewhere(tmp_path: Path, device: str) -> tuple[dict, dict]:
    """(uninterrupted rows, resumed rows) by step."""
    common = [*RUN, f"run.device={device}"]
    whole = jobs.run_flashcp(CONFIG, [*common, "checkpoint.resume=never"], tmp_path / "whole",
                             timeout=400)  # fmt: skip
    assert jobs.hygiene_problems(whole) == [], whole.summary()
    step2 = whole.out_dir / "checkpoints" / "step_2"
    assert step2.is_dir(), sorted(p.name for p in (whole.out_dir / "checkpoints").iterdir())
    resumed = jobs.run_flashcp(
        CONFIG, [*common, *OTHER_LAYOUT, f"checkpoint.resume={step2}"], tmp_path / "resumed",
        timeout=400,
    )  # fmt: skip
    assert jobs.hygiene_problems(resumed) == [], resumed.summary()
    assert "dp=2 pp=1 cp=1 ep=2" in resumed.output + resumed.log(0), resumed.summary()
    return _rows(whole.out_dir), _rows(resumed.out_dir)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_bf16_zero_ep_checkpoint_resumes_in_another_dp_cp_layout(tmp_path: Path) -> None:
    whole, resumed = save_and_resume_elsewhere(tmp_path, "cpu")
    assert sorted(whole) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for step in (3, 4):
        want = whole[step]
        assert resumed[step]["targets"] == want["targets"]  # the same sequences
        n, scale = numerics.metric_basis(want, "loss")
        numerics.assert_close(resumed[step]["loss"], want["loss"], n=n, scale=scale,
                              steps=step - 2, what=f"resumed loss step {step}")  # fmt: skip
        got, norm = float(resumed[step]["grad_norm"]), float(want["grad_norm"])
        assert abs(got - norm) <= BF16_GRAD_RTOL * norm, (step, got, norm)
    n, scale = numerics.metric_basis(whole[3], "loss")
    numerics.assert_rejects(whole[2]["loss"], whole[3]["loss"], n=n, scale=scale)
    assert abs(whole[2]["grad_norm"] - whole[3]["grad_norm"]) > 10 * BF16_GRAD_RTOL * abs(
        whole[3]["grad_norm"])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason=SKIP_NO_GPU + " (needs 2 GPUs)")
@pytest.mark.timeout(900)
def test_gpu_bf16_zero_ep_checkpoint_resumes_in_another_dp_cp_layout(tmp_path: Path) -> None:
    whole, resumed = save_and_resume_elsewhere(tmp_path, "gpu")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        a, b = float(resumed[step]["loss"]), float(whole[step]["loss"])
        assert abs(a - b) <= BF16_LOSS_RTOL * max(1.0, abs(b)), (step, a, b)
    assert abs(whole[2]["loss"] - whole[4]["loss"]) > BF16_LOSS_RTOL * abs(whole[4]["loss"])
