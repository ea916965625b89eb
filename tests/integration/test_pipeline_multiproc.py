"""Pipeline parallelism on gloo: PP = 2 and 3, and CP = 2 × PP = 2, equal one process.

The worker (`workers/pipeline_worker.py`) runs the tiny GPT and tiny GLM presets (and ERNIE-4.5
and Qwen2.5, whose families tie the head to the embedding, and Qwen3-MoE) on
causal-document masks under the 1F1B (and GPipe) schedule and compares every stage
parameter's gradient and the losses with the single-process step built from the same seed:

* without CP the comparison is BITWISE by construction: each stage runs exactly the
  operations one process runs, activations / gradients travel as raw float32, and every stage
  accumulates the micro-batches' gradients in the same (ascending) order;
* with CP it is bitwise against CP = 2 × PP = 1 (the pipeline adds no arithmetic), and within
  the float32 rule of `bench.numerics` against CP = 1 × PP = 1 after summing over the cp
  group (CP reorders sums) — while labels shifted after sharding miss it by a wide margin;
* a tied embedding/head matrix is within the rule (one process adds embedding and head
  gradients per micro-batch, the pipeline adds the two stages' totals once) and bitwise equal
  on the first and last stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.numerics import FACTOR
from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "pipeline_worker.py"
pytestmark = pytest.mark.integration

HIDDEN, VOCAB, BATCH, SEQ = 64, 260, 2, 32  # the worker's shapes (tiny presets)


def _reports(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _expected_sent(case: dict, pp: int, cp: int) -> int:
    """Bytes one rank sends point-to-point in a step: activations down, gradients up."""
    act = BATCH * (SEQ // cp) * HIDDEN * 4
    stage, m = case["stage"], case["num_micro"]
    sent = m * act * (stage < pp - 1) + m * act * (stage > 0)
    if case["tied_embeddings"] and stage in (0, pp - 1):
        sent += VOCAB * HIDDEN * 4
    return sent


@pytest.mark.equivalence
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pp", "cp"), [(2, 1), (3, 1), (2, 2)], ids=["pp2", "pp3", "cp2xpp2"])
def test_pipeline_equals_single_process(pp: int, cp: int, tmp_path: Path) -> None:
    nproc = pp * cp
    result = run_launch(
        WORKER, nproc, ["--out", str(tmp_path), "--pp", str(pp), "--cp", str(cp)], timeout=100
    )
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    reports = _reports(tmp_path, nproc)
    names = [c["case"] for c in reports[0]["cases"]]
    for rep in reports:
        assert rep["pp_rank"] == (rep["rank"] // cp) % pp and rep["cp_rank"] == rep["rank"] % cp
        assert [c["case"] for c in rep["cases"]] == names
        for case in rep["cases"]:
            assert case["ok"], case
            assert case["loss_bitwise"] and case["micro_bitwise"], case
            assert case["not_bitwise"] == case["tied"], case  # only the tied matrix may differ
            assert case["p2p_bytes_sent"] == _expected_sent(case, pp, cp), case
            if cp > 1:  # errors in units of the rule, which allows FACTOR
                assert case["cp_reduced_grad_err"] <= FACTOR, case
                assert case["cp_loss_err"] <= FACTOR, case
                assert case["label_shift_units"] > 10 * FACTOR, case
    for i, name in enumerate(names):
        for c in range(cp):
            stages = sorted(
                (rep["cases"][i] for rep in reports if rep["cp_rank"] == c),
                key=lambda x: x["stage"],
            )
            assert [s["stage"] for s in stages] == list(range(pp))
            # The stages' layer ranges tile the model; their parameters partition it.
            assert stages[0]["layers"][0] == 0
            for a, b in zip(stages, stages[1:], strict=False):
                assert a["layers"][1] == b["layers"][0], name
            owned = [p for s in stages for p in s["params"]]
            tied = set(stages[0]["tied"])
            assert set(owned) == set(stages[0]["ref_params"]), name
            assert len(owned) == len(set(owned)) + len(tied), name
            assert len({s["loss"] for s in stages}) == 1, name  # summed over the pp group
            if tied:
                assert stages[0]["tied_grad_sha"] == stages[-1]["tied_grad_sha"], name
                assert max(stages[0]["tied_err"].values()) <= FACTOR, name


@pytest.mark.timeout(90)
def test_pipeline_peer_hang_times_out_with_message(tmp_path: Path) -> None:
    result = run_launch(
        WORKER,
        2,
        ["--out", str(tmp_path), "--pp", "2", "--hang-stage", "1"],
        timeout=80,
        env={"FLASHCP_COLLECTIVE_TIMEOUT": "3"},
    )
    assert not result.ok and not result.timed_out, result.summary()
    log = result.log(0)
    assert "send(to rank 1)" in log and "timed out after 3 s on rank 0" in log, result.summary()
    assert "rank 1 may be dead, hung" in log, result.summary()
