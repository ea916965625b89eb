"""Evaluation under launched layouts equals the one-process evaluation.

* pretrain, dp = 2 × cp = 2 (4 processes): each eval row is cp-sharded and the last eval batch
  of an odd number of rows leaves one dp rank without a row; `eval/loss` is the same
  token-weighted mean as in one process (dp = cp = 1, micro-batch 2: the same rows per batch)
  within the float32 rule of `bench.numerics`, the counts exactly; a wrong eval (one step
  stale) is rejected by the same rule.
* MoE + DPO + LoRA, pp = 2 × cp = 2 (4 processes): the reference (adapters off) and the
  policy run forward through the pipeline, each answer's log-prob sum all-reduced over cp, the
  DPO terms on the last stage (reported by cp rank 0): loss, rewards and log-prob sums within
  the rule's DPO basis (answer tokens per pair, β·|log π|), counts and accuracy exactly.
* `flashcp eval RUN_DIR parallel.cp=2` (the CLI, its launcher, 2 processes) on a run trained
  here in one process: the checkpoint's eval under CP = 2 equals the run's own last eval within
  the float32 rule, counts exactly; the run's first eval (other weights) is rejected.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from bench import numerics
from bench.jobs import leftover_after, start_job
from flashcp.data.sources import BUILTIN_CORPUS, read_records
from flashcp.metrics.writer import read_metrics
from flashcp.rundir import EVAL_RESULTS_FILE
from helpers.paths import ROOT
from helpers.trainruns import train_in_process, train_launched

pytestmark = pytest.mark.integration

CONFIGS = ROOT / "configs"
STEPS = 2
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "eval.every=1"]


def _evals(run: Path) -> list[dict[str, float]]:
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [{k: v for k, v in r.items() if k.startswith("eval/")} for r in rows]


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_lm_eval_dp2_cp2_equals_one_process(tmp_path: Path) -> None:
    docs = read_records(BUILTIN_CORPUS)[-15:]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = CONFIGS / "gpt" / "tiny_cp2.yaml"
    common = [*COMMON, f"eval.path={path}"]
    ref = train_in_process(config, tmp_path / "ref", [*common, "parallel.cp=1"])
    run = train_launched(
        config, tmp_path / "run", 4,
        [*common, "parallel.dp=2", "data.micro_batch_size=1"],
    )  # fmt: skip
    got, want = _evals(run), _evals(ref)
    assert want[0]["eval/rows"] % 2 == 1  # the last batch has one row: dp rank 1 gets none
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        for key in ("eval/rows", "eval/batches", "eval/targets"):
            assert a[key] == b[key], (key, step)
        n, scale = b["eval/targets"], b["eval/loss"]
        numerics.assert_close(
            a["eval/loss"], b["eval/loss"], n=n, scale=scale, steps=step, what=f"eval {step}"
        )
    numerics.assert_rejects(got[0]["eval/loss"], want[1]["eval/loss"], n=n, scale=scale, steps=2)
    # and training itself matched as always
    for a, b in zip(read_metrics(run), read_metrics(ref), strict=True):
        n, scale = numerics.metric_basis(b, "loss")
        numerics.assert_close(a["loss"], b["loss"], n=n, scale=scale, steps=int(b["step"]))


@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_dpo_lora_eval_pp2_cp2_equals_one_process(tmp_path: Path) -> None:
    lines = (ROOT / "src" / "flashcp" / "data" / "dpo_default.jsonl").read_text().splitlines()
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines[-7:]) + "\n")
    config = CONFIGS / "glm" / "tiny_moe_dpo_lora_pp2_cp2.yaml"
    common = [*COMMON, f"eval.path={path}"]
    run = train_launched(config, tmp_path / "run", 4, common)
    one = ["parallel.pp=1", "parallel.cp=1", "parallel.pp_layers=null"]
    ref = train_in_process(config, tmp_path / "ref", [*common, *one])
    got, want = _evals(run), _evals(ref)
    beta = 0.1
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        for key in ("eval/examples", "eval/targets", "eval/rows", "eval/rewards/accuracy"):
            assert a[key] == b[key], (key, step)
        assert b["eval/examples"] == 7
        # the rule's DPO basis: answer tokens per pair, β·(|log π(chosen)| + |log π(rejected)|)
        n = b["eval/targets"] / b["eval/examples"]
        scale = beta * (abs(b["eval/logps/chosen"]) + abs(b["eval/logps/rejected"]))
        for key in ("eval/loss", "eval/rewards/chosen", "eval/rewards/rejected",
                    "eval/rewards/margin"):  # fmt: skip
            numerics.assert_close(a[key], b[key], n=n, scale=scale, steps=step, what=key)
        for key in ("eval/logps/chosen", "eval/logps/rejected"):
            numerics.assert_close(a[key], b[key], n=n, scale=abs(b[key]), steps=step, what=key)
    # a stale eval (step 1's policy) is rejected by the same rule
    numerics.assert_rejects(
        got[0]["eval/rewards/margin"], want[1]["eval/rewards/margin"], n=n, scale=scale, steps=2
    )


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_flashcp_eval_of_a_checkpoint_at_cp2(tmp_path: Path) -> None:
    docs = read_records(BUILTIN_CORPUS)[-9:]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = CONFIGS / "gpt" / "tiny_cp2.yaml"
    overrides = [f"train.steps={STEPS}", "eval.every=1", f"eval.path={path}",
                 f"checkpoint.every={STEPS}", "parallel.cp=1"]  # fmt: skip
    run = train_in_process(config, tmp_path / "run", overrides)
    marker = uuid.uuid4().hex
    job = start_job([sys.executable, "-m", "flashcp", "eval", str(run), "parallel.cp=2"], marker)
    code, timed_out, output = job.wait(180)
    assert code == 0 and not timed_out, output
    assert leftover_after(marker) == []
    assert "launching 2 process(es)" in output and "flashcp eval pretrain: loss" in output
    result = json.loads((run / EVAL_RESULTS_FILE).read_text())
    assert result["degrees"]["cp"] == 2 and result["weights"]["step"] == STEPS
    got, want = result["metrics"], _evals(run)
    for key in ("eval/rows", "eval/batches", "eval/targets"):
        assert got[key] == want[-1][key], key
    n, scale = want[-1]["eval/targets"], want[-1]["eval/loss"]
    numerics.assert_close(got["eval/loss"], want[-1]["eval/loss"], n=n, scale=scale)
    numerics.assert_rejects(got["eval/loss"], want[0]["eval/loss"], n=n, scale=scale)
