"""The DPO / LoRA / pipeline recipes launched on CPU processes equal one process.

Each shipped tiny config is launched at least once, by `python -m paddle.distributed.launch
... src/flashcp/train.py --config CONFIG` or by `flashcp train CONFIG`, and compared with the
same config trained in this process with pp = cp = 1:

* DPO + LoRA, CP = 2: the per-answer log-prob sums are partial per cp rank and all-reduced
  (identity backward) before the loss: losses, rewards and adapter gradients within the float32
  rule of `bench.numerics` (the rewards are β × small differences of answer log-prob sums
  over ~50 tokens, so their allowance scales with β·|log π|, not with the reward); DP = 2 too;
* DPO + LoRA, PP = 2, and DPO with a frozen reference copy, PP = 2: the reference pass streams
  forward through the pipeline, the losses run on the last stage, each stage runs the
  single-process operations in the same order: BITWISE equal by construction;
* the combined MoE + DPO + LoRA + PP = 2 × CP = 2 job (4 processes, `flashcp train`): every
  rank exits 0, metrics and gradients within the rule, and the adapters it exports (one
  PaddleFormers shard per stage) load with PaddleFormers and match the single-process ones;
* packed SFT, CP = 2: within the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import paddle
import pytest

from bench import numerics
from bench.jobs import dpo_beta, run_flashcp
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.models import build_model
from helpers.paths import CONFIGS, ROOT
from helpers.trainruns import (
    assert_training_matches,
    load_grads,
    losses,
    merged_tensors,
    train_in_process,
    train_launched,
)

pytestmark = pytest.mark.integration

STEPS = 3
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "debug.dump_grads=true"]
ONE_PROCESS = ["parallel.pp=1", "parallel.cp=1", "parallel.pp_layers=null"]


def in_process(config: Path, out: Path, overrides: Sequence[str] = ()) -> Path:
    """`config` trained here with pp = cp = 1."""
    return train_in_process(config, out, [*COMMON, *ONE_PROCESS, *overrides])


def launch(config: Path, out: Path, nproc: int, overrides: Sequence[str] = ()) -> Path:
    """`config` launched on `nproc` processes."""
    return train_launched(config, out, nproc, [*COMMON, *overrides])


def assert_bitwise(run: Path, ref: Path, *, pp: int) -> None:
    assert losses(run) == losses(ref)
    assert [r["grad_norm"] for r in read_metrics(run)] == [
        r["grad_norm"] for r in read_metrics(ref)
    ]
    for step in range(1, STEPS + 1):
        got, want = load_grads(run, step, pp), load_grads(ref, step)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} step {step}")


@pytest.mark.equivalence
@pytest.mark.timeout(200)
def test_dpo_lora_cp2_matches_cp1(tmp_path: Path) -> None:
    config = CONFIGS / "glm" / "tiny_dpo_lora_cp2.yaml"
    ref = in_process(config, tmp_path / "ref")
    run = launch(config, tmp_path / "run", 2)
    assert_training_matches(run, ref, steps=STEPS, beta=dpo_beta(config))
    assert all(name.endswith(("lora_A", "lora_B")) for name in load_grads(run, 1))
    assert losses(ref)[0] == pytest.approx(np.log(2))  # policy == reference at step 1


@pytest.mark.equivalence
@pytest.mark.timeout(200)
def test_dpo_lora_dp2_matches_one_process(tmp_path: Path) -> None:
    # dp = 2 × 1 row per rank trains on the rows of dp = 1 × 2 rows; the loss is averaged
    # over the pairs of BOTH dp ranks
    config = CONFIGS / "glm" / "tiny_dpo_lora_cp2.yaml"
    ref = in_process(config, tmp_path / "ref", ["data.micro_batch_size=2"])
    run = launch(config, tmp_path / "run", 2, ["parallel.cp=1", "parallel.dp=2"])
    assert_training_matches(run, ref, steps=STEPS, beta=dpo_beta(config))


@pytest.mark.timeout(200)
def test_dpo_lora_pp2_equals_pp1_bitwise(tmp_path: Path) -> None:
    config = CONFIGS / "glm" / "tiny_dpo_lora_pp2.yaml"
    merge = ["lora.merge_at_end=true"]
    run = launch(config, tmp_path / "run", 2, merge)
    ref = in_process(config, tmp_path / "ref", merge)
    assert_bitwise(run, ref, pp=2)
    # the merged export, streamed stage by stage (one shard per stage + the index), holds
    # exactly the one-process export's tensors
    got, want = merged_tensors(run / "merged"), merged_tensors(ref / "merged")
    assert sorted(p.name for p in (run / "merged").glob("model-*.safetensors")) == [
        f"model-0000{s}-of-00002.safetensors" for s in (1, 2)
    ]
    assert got.keys() == want.keys() and "lm_head.weight" in want
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.timeout(200)
def test_dpo_frozen_reference_pp2_equals_pp1_bitwise(tmp_path: Path) -> None:
    # no lora section: the reference is a frozen copy, split into stages like the policy
    text = (CONFIGS / "glm" / "tiny_dpo_lora_pp2.yaml").read_text()
    config = tmp_path / "dpo_pp2.yaml"
    config.write_text(text[: text.index("lora:")] + text[text.index("checkpoint:") :])
    run = launch(config, tmp_path / "run", 2)
    ref = in_process(config, tmp_path / "ref")
    assert_bitwise(run, ref, pp=2)
    assert len(load_grads(ref, 1)) > 20  # every parameter trains


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_combined_moe_dpo_lora_pp2_cp2_via_flashcp_train(tmp_path: Path) -> None:
    config = CONFIGS / "glm" / "tiny_moe_dpo_lora_pp2_cp2.yaml"
    job = run_flashcp(config.relative_to(ROOT), COMMON, tmp_path / "run", timeout=150)
    assert job.returncode == 0 and not job.timed_out, job.summary()
    out = job.output
    assert "launching 4 process(es)" in out and f"step {STEPS}/{STEPS}" in out
    run = tmp_path / "run"
    for rank in range(4):
        log = (run / "logs" / f"workerlog.{rank}").read_text(errors="replace")
        assert "Traceback" not in log, log[-2000:]
    ref = in_process(config, tmp_path / "ref")
    assert_training_matches(run, ref, steps=STEPS, pp=2, beta=dpo_beta(config))
    # one adapter shard per stage; PaddleFormers loads the directory into the full model
    from flashcp.lora.model import load_adapters

    shards = sorted(p.name for p in (run / "adapters").glob("peft_model-*.safetensors"))
    assert shards == [f"peft_model-0000{s}-of-00002.safetensors" for s in (1, 2)]
    cfg = load_config(config)
    adapters = {}
    for directory in (run / "adapters", ref / "adapters"):
        paddle.seed(0)
        model = load_adapters(build_model(cfg.model), directory)
        adapters[directory] = {
            n: p.numpy() for n, p in model.model.named_parameters() if not p.stop_gradient
        }
    got, want = adapters.values()
    assert set(got) == set(want) and len(want) == 16
    # The trained adapters differ by the difference of the updates, and AdamW moves each
    # element by at most ~lr per step: the scale is Σ lr · √numel, the tokens the gradients
    # summed over are the steps' targets.
    rows = read_metrics(ref)
    lr_sum, targets = sum(r["lr"] for r in rows), max(r["targets"] for r in rows)
    for name in want:
        numerics.assert_close(
            got[name], want[name], n=targets, scale=lr_sum * np.sqrt(want[name].size),
            steps=STEPS, norm="l2", what=f"adapter {name}",
        )  # fmt: skip


@pytest.mark.equivalence
@pytest.mark.timeout(200)
def test_sft_packed_cp2_matches_cp1(tmp_path: Path) -> None:
    config = CONFIGS / "gpt" / "tiny_sft_packed_cp2.yaml"
    ref = in_process(config, tmp_path / "ref")
    run = launch(config, tmp_path / "run", 2)
    assert_training_matches(run, ref, steps=STEPS, beta=dpo_beta(config))
    first = read_metrics(ref)[0]
    assert 0 < first["targets"] < first["tokens"]  # only response tokens are targets
