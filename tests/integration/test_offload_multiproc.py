"""Activation offload through the trainer, launched: the same losses and gradients, BITWISE.

`train.offload_activations: true` moves what recomputed layers keep (their inputs; refined's
attention outputs) to numpy buffers and back, and frees a pipeline stage's sent output: the
same operations in the same order on every rank, so each layout's offloaded run equals its
plain run bitwise (losses, gradient norms, every dumped gradient):

* CP = 2 (tiny GLM-4, full recompute);
* PP = 2 × CP = 2 (tiny GLM-4, refined recompute, 1F1B: two micro-batches in flight on the
  first stage, each with its own chain of host copies);
* DPO + LoRA, CP = 2 (the reference pass runs without gradients: nothing to offload);
* MoE with expert parallelism, EP = 2 carved from CP = 2 (the all-to-all PyLayers inside the
  layers pass through the offload hooks);
* PP = 2 with a bf16 residual stream (`model.residual_dtype`, the transfers in bf16), against
  the one-process run of the same model.

Golden style: the shipped tiny MoE configs with offload on, as real `flashcp train` jobs,
are on `tests/golden/losses.json` (recompute and offload change no number).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import jobs
from flashcp.metrics.writer import read_metrics
from helpers.paths import ROOT
from helpers.trainruns import load_grads, train_in_process, train_launched

pytestmark = pytest.mark.integration

GLM = ROOT / "configs" / "glm" / "tiny_cp2.yaml"
GPT = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"
DPO_LORA = ROOT / "configs" / "glm" / "tiny_dpo_lora_cp2.yaml"
MOE_EP = ROOT / "configs" / "glm" / "tiny_moe_ep2_cp2.yaml"
STEPS = 3
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "debug.dump_grads=true"]
OFFLOAD = "train.offload_activations=true"

CASES = {
    "cp2_full": (GLM, 2, 1, ["model.recompute=full"]),
    "pp2_cp2_refined": (
        GLM,
        4,
        2,
        ["model.recompute=refined", "parallel.pp=2", "train.grad_accum=2"],
    ),
    "dpo_lora_cp2": (DPO_LORA, 2, 1, ["model.recompute=full"]),
    "moe_ep2_cp2": (MOE_EP, 2, 1, []),
}


def _assert_bitwise(run: Path, ref: Path, pp: int) -> None:
    mine, want = read_metrics(run), read_metrics(ref)
    assert len(mine) == len(want) == STEPS
    for key in ("loss", "grad_norm", "targets", "tokens"):
        assert [r[key] for r in mine] == [r[key] for r in want], key
    for step in range(1, STEPS + 1):
        got, expected = load_grads(run, step, pp), load_grads(ref, step, pp)
        assert set(got) == set(expected)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{name} {step}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(CASES))
def test_offload_equals_the_plain_run_bitwise(case: str, tmp_path: Path) -> None:
    config, nproc, pp, overrides = CASES[case]
    plain = train_launched(config, tmp_path / "plain", nproc, [*COMMON, *overrides])
    moved = train_launched(config, tmp_path / "offload", nproc, [*COMMON, *overrides, OFFLOAD])
    _assert_bitwise(moved, plain, pp)
    assert all(r["offload/host_peak_gib"] > 0 for r in read_metrics(moved))  # it did move
    assert all("offload/host_peak_gib" not in r for r in read_metrics(plain))
    # negative control: the comparison sees a one-step difference in the data order
    other = read_metrics(plain)
    assert [r["loss"] for r in read_metrics(moved)][1:] != [r["loss"] for r in other][:-1]


@pytest.mark.timeout(400)
def test_pp2_bfloat16_residual_with_offload_equals_one_process(tmp_path: Path) -> None:
    """The transfers between stages carry the bf16 stream (and its bf16 gradient): PP = 2
    with offload equals the one-process run of the same model, bitwise."""
    shape = [
        *COMMON,
        "model.residual_dtype=bfloat16",
        "model.recompute=full",
        "parallel.cp=1",
        "train.grad_accum=2",
        "data.micro_batch_size=1",
    ]
    ref = train_in_process(GPT, tmp_path / "ref", shape)
    run = train_launched(GPT, tmp_path / "run", 2, [*shape, "parallel.pp=2", OFFLOAD])
    _assert_bitwise_pp(run, ref)
    # stage 0 (1 of the 2 layers) holds its layer's bf16 input [1, 256, 64] of both
    # micro-batches at once under 1F1B (F0 F1 B0 B1), every step; stage 1 one at a time
    want = 2 * (1 * 256 * 64) * 2 / 2**30
    assert [r["offload/host_peak_gib"] for r in read_metrics(run)] == [want] * STEPS
    # negative control: the float32 stream gives other losses
    f32 = train_in_process(GPT, tmp_path / "f32", [*shape, "model.residual_dtype=float32"])
    assert [r["loss"] for r in read_metrics(f32)] != [r["loss"] for r in read_metrics(ref)]


def _assert_bitwise_pp(run: Path, ref: Path) -> None:
    mine, want = read_metrics(run), read_metrics(ref)
    assert [r["loss"] for r in mine] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in mine] == [r["grad_norm"] for r in want]
    for step in range(1, STEPS + 1):
        got, expected = load_grads(run, step, 2), load_grads(ref, step, 1)
        assert set(got) == set(expected)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{name} {step}")


GOLDEN = ("configs/glm/tiny_moe_ep2_cp2.yaml", "configs/glm/tiny_moe_dpo_lora_pp2_cp2.yaml")


@pytest.mark.equivalence
@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", GOLDEN)
def test_offloaded_job_is_on_the_golden_losses(config: str, tmp_path: Path) -> None:
    overrides = [*jobs.golden_overrides(), "model.recompute=full", OFFLOAD]
    run = jobs.run_flashcp(config, overrides, tmp_path / "run")
    assert jobs.hygiene_problems(run) == [], run.summary()
    want = jobs.load_golden()["jobs"][config]
    problems = jobs.compare_losses(config, want, jobs.golden_entry(run))
    assert not problems, "\n".join(problems)
