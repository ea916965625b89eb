"""Pipeline parallelism through the trainer (`parallel.pp`): PP = 2 trains exactly like one
process, resumes exactly, and its checkpoints load into another pipeline layout.

The single-process reference runs in this process with `parallel.pp=1`; the launched jobs split
the same model into stages (every rank builds it from the same seed and keeps its stage), run
the 1F1B (or GPipe) schedule over `train.grad_accum` micro-batches and dump each stage's summed
gradients every step (`debug.dump_grads`: `grads/step_N.stageS.safetensors`).

* PP = 2 (tiny GPT, untied): each stage runs the single-process operations in the same order,
  the loss lives on the last stage, and clipping uses the whole model's norm with the
  single-process arithmetic (`flashcp.optim.clip`), so losses, gradient norms and gradients
  are BITWISE equal, clipping active;
* PP = 2 × CP = 2 (tiny GLM, tied embeddings, uneven split [1, 2], GPipe): within the float32
  rule of `bench.numerics` (CP reorders sums; the tied matrix adds the two stages'
  gradients once per step);
* resuming PP = 2 in the same layout repeats the same operations: bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from flashcp.checkpoint.checkpointer import GRADS_DIR
from flashcp.metrics.writer import read_metrics
from helpers.paths import ROOT
from helpers.trainruns import (
    assert_training_matches,
    load_grads,
    losses,
    train_in_process,
    train_launched,
)

pytestmark = pytest.mark.integration

GPT = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"
GLM = ROOT / "configs" / "glm" / "tiny_cp2.yaml"
STEPS = 4
COMMON = [
    f"train.steps={STEPS}",
    "checkpoint.every=0",
    "debug.dump_grads=true",
    "train.grad_accum=2",
    "data.micro_batch_size=1",
    "parallel.cp=1",
]


def in_process(config: Path, out: Path, overrides: list[str]) -> Path:
    """Train `config` in this process (pp = cp = 1)."""
    return train_in_process(config, out, [*COMMON, *overrides])


def launch(config: Path, out: Path, nproc: int, overrides: list[str]) -> Path:
    return train_launched(config, out, nproc, [*COMMON, *overrides])


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return in_process(GPT, tmp_path_factory.mktemp("pp1") / "run", [])


@pytest.fixture(scope="module")
def gpt_pp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(GPT, tmp_path_factory.mktemp("pp2") / "run", 2, ["parallel.pp=2"])


@pytest.mark.timeout(200)
def test_pp2_equals_pp1_bitwise(gpt_pp2: Path, gpt_reference: Path) -> None:
    assert losses(gpt_pp2) == losses(gpt_reference)
    mine, want = read_metrics(gpt_pp2), read_metrics(gpt_reference)
    assert [r["grad_norm"] for r in mine] == [r["grad_norm"] for r in want]
    assert all(r["grad_norm"] > 1.0 for r in want)  # train.grad_clip 1.0 was active
    for step in range(1, STEPS + 1):
        ref = load_file(str(gpt_reference / GRADS_DIR / f"step_{step}.safetensors"))
        got = load_grads(gpt_pp2, step, 2)
        assert set(got) == set(ref)
        for name in ref:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{name} step {step}")


@pytest.mark.timeout(200)
def test_pp2_resumes_exactly_and_loads_into_pp1(
    tmp_path: Path, gpt_pp2: Path, gpt_reference: Path
) -> None:
    run = tmp_path / "run"
    ck = ["parallel.pp=2", "checkpoint.every=2"]
    launch(GPT, run, 2, [*ck, "run.stop_after_steps=2"])
    step2 = run / "checkpoints" / "step_2"
    assert (step2 / "model-00002-of-00002.safetensors").is_file()
    assert (step2 / "optimizer-00001-of-00002.safetensors").is_file()
    launch(GPT, run, 2, ck)
    assert losses(run) == losses(gpt_pp2)  # 2 + 2 steps == 4 uninterrupted steps, bitwise
    # The stage parts merge by parameter name: the PP = 2 checkpoint resumes at PP = 1.
    single = in_process(GPT, tmp_path / "pp1", [f"checkpoint.resume={step2}"])
    assert losses(single) == losses(gpt_reference)[2:]


@pytest.mark.equivalence
@pytest.mark.timeout(200)
def test_pp2_cp2_tied_gpipe_matches_one_process(tmp_path: Path) -> None:
    shape = ["model.tie_embeddings=true", "model.num_layers=3"]
    ref = in_process(GLM, tmp_path / "ref", shape)
    layout = ["parallel.pp=2", "parallel.cp=2", "parallel.pp_layers=[1,2]"]
    run = launch(GLM, tmp_path / "run", 4, [*shape, *layout, "parallel.pp_schedule=gpipe"])
    assert_training_matches(run, ref, steps=STEPS, pp=2)
    check_run_info(run, ref, layers=[range(0, 1), range(1, 3)])


def check_run_info(run: Path, ref: Path, *, layers: list[range]) -> None:
    """run_info.json of the PP = 2 × CP = 2 job: every rank materialised only its stage's
    share of the one-process model (counted by name from the reference's gradient dump), and
    metrics.jsonl's peak memory is the maximum over the ranks."""
    info = json.loads((run / "run_info.json").read_text())
    assert info["world"] == 4 and info["degrees"] == {"dp": 1, "pp": 2, "cp": 2, "ep": 1}
    assert info["param_dtype"] == "float32"
    planned = {r["rank"]: r for r in info["plan"]["ranks"]}  # flashcp.plan, per rank
    assert sorted(planned) == [0, 1, 2, 3] and info["plan"]["device"] == "cpu"
    whole = {
        n: int(v.size) for n, v in load_file(str(ref / GRADS_DIR / "step_1.safetensors")).items()
    }
    ranks = info["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert sorted(r["stage"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        s, mine = r["stage"], layers[r["stage"]]

        def held(name: str, s: int = s, mine: range = mine) -> bool:
            if name.startswith("model.layers."):
                return int(name.split(".")[2]) in mine
            if name == "model.embed_tokens.weight":  # tied: the last stage has its own copy
                return True
            return s == 1  # final norm

        share = sum(v for n, v in whole.items() if held(n))
        assert r["layers"] == [mine.start, mine.stop]
        assert r["params_local"] == r["trainable_params_local"] == share
        assert r["param_bytes_local"] == 4 * share
        plan_r = planned[r["rank"]]  # the plan counts exactly what the rank built
        assert plan_r["stage"] == s and plan_r["items"]["params_trained"] == 4 * share
        assert r["params_local"] < sum(whole.values())  # nobody built the whole model
        assert r["allocated_bytes"] >= r["param_bytes_local"]
        assert r["peak_bytes"] < 4 * sum(whole.values())  # not even briefly
    records = read_metrics(run)
    for rec in records:
        assert rec["peak_memory_rank"] in range(4)
        assert rec["peak_memory_gib"] * 2**30 >= max(r["allocated_bytes"] for r in ranks)
