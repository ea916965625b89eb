"""ZeRO-2 (`parallel.shard_gradients`) in launched gloo jobs: the same training as ZeRO-1, the
gradients reduce-scattered during backward, the memory that saves, checkpoints across layouts.

Runs (tiny GPT unless said, 6 steps of 64-token sequences; one 4-rank job, then one 2-rank job,
`workers/zero_worker.py`), each ZeRO-2 run beside the ZeRO-1 run of the same layout:

* DP=2×CP=2 and CP=2 with one micro-batch per step: BITWISE ZeRO-1's losses and gradient norms
  (each rank's shard gradient is the same float32 reduce-scatter of the same flat bucket: the
  ring adds the ranks in the same order, and the first micro-batch's slice becomes the shard);
* with `train.grad_accum` = 2 - CP=2 under full recompute (the hooks fire in each layer's
  replay), PP=2×CP=2 with tied embeddings (the tied copy's bucket deferred to the step, summed
  across stages first), bf16 storage (`bf16toy`), and the tiny GLM-4.5 MoE with ep=2 over
  DP=2×CP=2 (expert gradients over their edp group): the float32 sums run over the ranks, then
  over the micro-batches, instead of the reverse. Tolerance: `bench.numerics`'s rule, for
  the loss of step k (a mean over the step's target tokens) n = targets, scale = the loss,
  steps = k (step k's parameters went through k - 1 updates of gradients summed in another
  order; step 1 is computed from identical parameters and must be bitwise), the gradient norm
  likewise;
* NEGATIVE CONTROL: the classic ZeRO-2 bug - each micro-batch's slice replacing the shard
  gradient instead of adding to it - fails the same comparison (step 1's gradient norm) by far;
* memory (allocator, per rank, CP=2 tiny GLM with grad_bucket_mb 0.0625 and a 4096-token
  vocabulary, so the LM head is reduced in pieces): after backward a ZeRO-2 rank holds its
  shard gradients (float32, `layout.numel`) and no full-size gradient, every bucket was reduced
  during backward (buckets × micro-batches), and the backward peak is ZeRO-1's minus the
  full float32 gradients plus the shard (give or take one bucket's transients);
* checkpoints: the optimizer shard format is ZeRO-1's, so DP=2×CP=2 ZeRO-2's step-3 checkpoint
  resumes bitwise in its own layout, and at CP=2 under ZeRO-2 and ZeRO-1 within the rule
  against an uninterrupted run of that layout;
* a NaN gradient on one rank (`FLASHCP_FAULT` syntax, `train.on_nonfinite: skip`): the step is
  skipped on every rank as under ZeRO-1 (bitwise ZeRO-1's losses).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import numerics
from flashcp.metrics.writer import read_metrics
from helpers.launch import run_launch
from helpers.paths import ROOT

pytestmark = pytest.mark.integration

GPT = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"
GLM = ROOT / "configs" / "glm" / "tiny_cp2.yaml"
MOE = ROOT / "configs" / "glm" / "tiny_moe_ep2_cp2.yaml"
WORKER = Path(__file__).resolve().parent / "workers" / "zero_worker.py"
STEPS = 6
BASE = [
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "data.seq_len=64",
    "model.max_seq_len=64",
    "checkpoint.every=0",
    "parallel.grad_bucket_mb=0.01",  # 2621 elements: many buckets, the embedding alone in one
]
Z1 = ["parallel.shard_optimizer=true"]
Z2 = [*Z1, "parallel.shard_gradients=true"]
CP2 = ["parallel.cp=2", "data.micro_batch_size=2"]
CP2_ACCUM = ["parallel.cp=2", "data.micro_batch_size=1", "train.grad_accum=2",
             "model.recompute=full"]  # fmt: skip
DP2CP2 = ["parallel.dp=2", "parallel.cp=2", "data.micro_batch_size=1"]
ACCUM = ["train.grad_accum=2"]
PP2CP2 = ["parallel.pp=2", "parallel.cp=2", "data.micro_batch_size=1", "train.grad_accum=2",
          "model.tie_embeddings=true"]  # fmt: skip
EP = ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "data.micro_batch_size=1", *ACCUM]
MEM = ["model.preset=tiny_glm", "model.vocab_size=4096", "parallel.grad_bucket_mb=0.0625",
       "train.steps=2", "data.seq_len=256", "model.max_seq_len=256", *CP2_ACCUM]  # fmt: skip
NAN = ["train.on_nonfinite=skip"]
CKPT = ["checkpoint.every=3"]


def run(config: Path, overrides: list[str], **extra: Any) -> dict[str, Any]:
    return {"config": str(config), "overrides": [*BASE, *overrides], **extra}


def launch(tmp: Path, nproc: int, runs: dict[str, dict[str, Any]]) -> dict[str, Path]:
    out = {name: tmp / name for name in runs}
    plan = []
    for name, entry in runs.items():
        entry = {"toy": False, **entry}
        entry["overrides"] = [*entry["overrides"], f"run.output_dir={out[name]}"]
        plan.append(entry)
    (tmp / "plan.json").write_text(json.dumps(plan, indent=1))
    result = run_launch(
        WORKER, nproc, ["--plan", str(tmp / "plan.json")], timeout=900, log_dir=tmp / "logs"
    )
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    return out


def step3(path: Path) -> str:
    return f"checkpoint.resume={path / 'checkpoints' / 'step_3'}"


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("zero2_four")
    return launch(tmp, 4, {
        "dp_z1": run(GPT, [*DP2CP2, *Z1]),
        "dp_z2": run(GPT, [*DP2CP2, *Z2, *CKPT]),
        "dp_z2_resumed": run(GPT, [*DP2CP2, *Z2, step3(tmp / "dp_z2")]),
        "pp_z1": run(GPT, [*PP2CP2, *Z1]),
        "pp_z2": run(GPT, [*PP2CP2, *Z2], measure=str(tmp / "pp_z2" / "memory")),
        "bf16_z1": run(GPT, [*DP2CP2, *ACCUM, *Z1], toy=True),
        "bf16_z2": run(GPT, [*DP2CP2, *ACCUM, *Z2], toy=True),
        "ep_z1": run(MOE, [*EP, *Z1]),
        "ep_z2": run(MOE, [*EP, *Z2]),
    })  # fmt: skip


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, four: dict[str, Path]) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("zero2_two")
    fault = "nan_grad@step2:rank1"
    return launch(tmp, 2, {
        "cp_z1": run(GPT, [*CP2, *Z1]),
        "cp_z2": run(GPT, [*CP2, *Z2]),
        "accum_z1": run(GPT, [*CP2_ACCUM, *Z1]),
        "accum_z2": run(GPT, [*CP2_ACCUM, *Z2]),
        "accum_bug": run(GPT, [*CP2_ACCUM, *Z2], bug="zero2_overwrite"),
        "mem_z1": run(GLM, [*MEM, *Z1], measure=str(tmp / "mem_z1" / "memory")),
        "mem_z2": run(GLM, [*MEM, *Z2], measure=str(tmp / "mem_z2" / "memory")),
        "from_dp_z2": run(GPT, [*CP2, *Z2, step3(four["dp_z2"])]),
        "from_dp_z1": run(GPT, [*CP2, *Z1, step3(four["dp_z2"])]),
        "nan_z1": run(GPT, [*CP2, *Z1, *NAN], fault=fault),
        "nan_z2": run(GPT, [*CP2, *Z2, *NAN], fault=fault),
    })  # fmt: skip


def rows(path: Path) -> list[dict[str, Any]]:
    got = read_metrics(path)
    assert got and all(math.isfinite(r["loss"]) for r in got if not r.get("skipped")), path
    return got


def assert_same_training(got: Path, want: Path, *, first: int = 1) -> list[float]:
    """Losses and gradient norms of `got` against `want` (steps `first`..) under the rule;
    step 1 from identical parameters bitwise. Returns the errors in the rule's units."""
    units = []
    for a, b in zip(rows(got), rows(want)[first - 1 :], strict=True):
        step = int(b["step"]) - first + 1
        assert a["targets"] == b["targets"]
        for key in ("loss", "grad_norm"):
            n, scale = numerics.metric_basis(b, key)
            result = numerics.assert_close(a[key], b[key], n=n, scale=scale, steps=step,
                                           what=f"{got.name} {key} step {b['step']}")  # fmt: skip
            units.append(result.units)
    return units


def test_one_micro_batch_is_bitwise_zero1(four: dict[str, Path], two: dict[str, Path]) -> None:
    for z2, z1 in ((four["dp_z2"], four["dp_z1"]), (two["cp_z2"], two["cp_z1"])):
        a, b = rows(z2), rows(z1)
        assert len(a) == STEPS
        assert [r["loss"] for r in a] == [r["loss"] for r in b]
        assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    log = (four["dp_z2"].parent / "logs" / "workerlog.0").read_text()
    assert "ZeRO-2 sharded over dp × cp = 4 ranks" in log


@pytest.mark.parametrize("layout", ["accum", "pp", "bf16", "ep"])
def test_micro_batches_match_zero1_within_the_rule(
    four: dict[str, Path], two: dict[str, Path], layout: str
) -> None:
    runs = {**four, **two}
    z2, z1 = runs[f"{layout}_z2"], runs[f"{layout}_z1"]
    first_z2, first_z1 = rows(z2)[0], rows(z1)[0]
    assert first_z2["loss"] == first_z1["loss"]  # identical parameters, identical forward
    units = assert_same_training(z2, z1)
    print(f"{layout}: ZeRO-2 vs ZeRO-1, largest error {max(units):.3g} of {numerics.FACTOR:g}")
    # the run learns (a broken update in both would still compare equal)
    losses = [r["loss"] for r in rows(z1)]
    assert losses[-1] < losses[0]


def test_the_tied_copy_is_deferred_the_rest_reduced_in_backward(four: dict[str, Path]) -> None:
    """PP=2×CP=2 with tied embeddings: on both stages the tied matrix's bucket keeps its whole
    float32 gradient until the runner has summed the two stages' copies (ZeRO-1's path at the
    step); every other bucket was reduce-scattered during backward, once per micro-batch."""
    for rank in range(4):
        m = _memory(four["pp_z2"], rank)
        assert m["deferred_buckets"] == 1 and m["deferred_numel"] > 0
        for record in m["steps"]:
            assert record["full_grad_bytes"] == 4 * m["deferred_numel"]
            assert record["reduced_in_backward"] == 2 * (m["buckets"] - 1)


def test_overwriting_the_shard_gradient_is_rejected(two: dict[str, Path]) -> None:
    """Negative control: keeping only the last micro-batch's slice changes step 1's gradient
    norm (computed from identical parameters) far beyond the rule that the correct run meets."""
    want, bug, good = rows(two["accum_z1"])[0], rows(two["accum_bug"])[0], rows(two["accum_z2"])[0]
    n, scale = numerics.metric_basis(want, "grad_norm")
    numerics.assert_close(good["grad_norm"], want["grad_norm"], n=n, scale=scale)
    numerics.assert_rejects(bug["grad_norm"], want["grad_norm"], n=n, scale=scale, margin=100)
    with pytest.raises(AssertionError):
        assert_same_training(two["accum_bug"], two["accum_z1"])


def _memory(path: Path, rank: int) -> dict[str, Any]:
    return json.loads((path / "memory" / f"rank{rank}.json").read_text())


def test_memory_shard_gradients_only(two: dict[str, Path]) -> None:
    for rank in (0, 1):
        z1, z2 = _memory(two["mem_z1"], rank), _memory(two["mem_z2"], rank)
        trained, shard = z2["trained"], z2["shard_numel"]
        assert z1["trained"] == trained and shard < trained // 2 + z2["buckets"]
        report = []
        for a, b in zip(z1["steps"], z2["steps"], strict=True):
            # ZeRO-1 keeps the whole float32 gradient; ZeRO-2 none, but its shard and the
            # float64 running sum of squares of the non-finite check; besides, both keep the
            # same few other bytes (held inside Paddle, not gradients)
            assert a["full_grad_bytes"] == 4 * trained and b["full_grad_bytes"] == 0
            kept1 = a["live_after_backward"] - a["live_before_backward"] - 4 * trained
            kept2 = b["live_after_backward"] - b["live_before_backward"] - (4 * shard + 8)
            assert kept1 == kept2 >= 0
            assert b["reduced_in_backward"] == 2 * z2["buckets"]  # every bucket, 2 micro-batches
            assert a["reduced_in_backward"] == 0
            saved = (a["backward_peak"] - a["live_before_backward"]) - (
                b["backward_peak"] - b["live_before_backward"]
            )
            expected = 4 * (trained - shard)
            transient = 3 * 4 * z2["largest_bucket"] // 2  # a piece, its cast, the ring's sums
            report.append((saved, expected))
            assert expected - transient <= saved <= expected, (saved, expected, transient)
        print(f"rank {rank}: backward peak saved (bytes, expected)", report)


def test_checkpoints_resume_across_layouts(four: dict[str, Path], two: dict[str, Path]) -> None:
    dp = rows(four["dp_z2"])
    resumed = rows(four["dp_z2_resumed"])
    assert [r["loss"] for r in resumed] == [r["loss"] for r in dp[3:]]  # same layout: bitwise
    shards = sorted(p.name for p in (four["dp_z2"] / "checkpoints" / "step_3").glob("optimizer-*"))
    assert len(shards) == 4  # one ZeRO-1-format shard per rank
    # DP2×CP2 → CP2, ZeRO-2 and ZeRO-1: an uninterrupted CP2 run's steps 4.. within the rule
    # (the state at step 3 differs from CP2's own by the first steps' summation order)
    for name, want in (("from_dp_z2", "cp_z2"), ("from_dp_z1", "cp_z1")):
        got = rows(two[name])
        assert [r["step"] for r in got] == list(range(4, STEPS + 1))
        for a, b in zip(got, rows(two[want])[3:], strict=True):
            n, scale = numerics.metric_basis(b, "loss")
            numerics.assert_close(a["loss"], b["loss"], n=n, scale=scale, steps=int(b["step"]),
                                  what=f"{name} loss step {b['step']}")  # fmt: skip


def test_a_nonfinite_gradient_skips_the_step_as_under_zero1(two: dict[str, Path]) -> None:
    z1, z2 = rows(two["nan_z1"]), rows(two["nan_z2"])
    assert [bool(r.get("skipped")) for r in z2] == [s == 2 for s in range(1, STEPS + 1)]
    assert [r["loss"] for r in z2] == [r["loss"] for r in z1]
    assert [r["loss"] for r in z2][2:] != [r["loss"] for r in rows(two["cp_z2"])][2:]
