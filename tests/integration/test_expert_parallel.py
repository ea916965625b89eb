"""Expert parallelism (`parallel.ep`) on launched gloo processes equals one process.

The reference trains `configs/glm/tiny_moe_ep2_cp2.yaml` (tiny GLM-4.5-style MoE: 4 routed
experts, top-2, a shared expert; router load balancing on) in this process with cp = ep = 1;
each launched job splits the routed experts over ep ranks carved from dp × cp (and pipeline
stages), sends the tokens to their experts and back (all-to-all over ordered gloo send/recv),
sums expert gradients over the ranks holding the same experts only, and dumps the stage's
summed gradients with the experts gathered whole. Compared with `assert_training_matches`
(the float32 rule of `bench.numerics`: losses, gradient norms, every gradient norm-wise):

* EP = 2 × CP = 2 (2 processes), EP = 4 over DP = 2 × CP = 2 (4 processes), and PP = 2 × CP = 2
  × EP = 2 (4 processes, DPO with LoRA adapters on the attention AND the routed experts, the
  merged export streamed per ep rank);
* the router's expert loads (the bias update's input) are summed over every rank: equal
  exactly; the sequence-balance loss within the rule;
* NEGATIVE CONTROL: the same EP = 2 job with a wrong expert offset (each rank's experts
  initialised as the next rank's; `workers/ep_bug_train.py`) must FAIL the same comparison by
  far;
* checkpoints hold the experts whole: an EP = 2 run resumed in the same layout is bitwise the
  uninterrupted one, and its checkpoint resumes at ep = 1 within the rule; so do the float32
  master-weight files of ZeRO-1 and of bf16 storage under ep;
* the pieces on 3 processes (odd: gloo pair links): exact all-to-all values and bytes, the
  gather, one MoE layer vs the whole layer with its own negative control
  (`workers/ep_worker.py`); and `scripts/bench_moe.py`'s ep part.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from bench import moe as bench
from bench import numerics
from flashcp.metrics.writer import read_metrics
from helpers.launch import run_launch
from helpers.paths import ROOT
from helpers.trainruns import (
    assert_training_matches,
    load_grads,
    losses,
    merged_tensors,
    train_in_process,
    train_launched,
)

pytestmark = pytest.mark.integration

CONFIG = ROOT / "configs" / "glm" / "tiny_moe_ep2_cp2.yaml"
DPO = ROOT / "configs" / "glm" / "tiny_moe_dpo_lora_pp2_cp2.yaml"
WORKERS = Path(__file__).resolve().parent / "workers"
STEPS = 3
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "debug.dump_grads=true"]
BALANCE = ["model.router_aux_loss_coef=0.01", "model.router_bias_update_rate=0.01"]
ONE = ["parallel.cp=1", "parallel.ep=1"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ep_ref") / "run"
    return train_in_process(CONFIG, out, [*COMMON, *BALANCE, *ONE])


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ep2") / "run"
    return train_launched(CONFIG, out, 2, [*COMMON, *BALANCE])


def assert_router_matches(run: Path, ref: Path) -> None:
    """Expert loads summed over every rank (integers): equal; the balance loss: the rule."""
    for got, want in zip(read_metrics(run), read_metrics(ref), strict=True):
        assert got["moe/max_over_mean_max"] == want["moe/max_over_mean_max"]
        aux = float(want["moe/aux_loss"])
        numerics.assert_close(got["moe/aux_loss"], aux, n=float(want["targets"]), scale=aux,
                              steps=int(want["step"]), what="moe/aux_loss")  # fmt: skip


@pytest.mark.equivalence
@pytest.mark.timeout(200)
def test_ep2_cp2_matches_one_process(ep2_run: Path, reference: Path) -> None:
    assert_training_matches(ep2_run, reference, steps=STEPS)
    assert_router_matches(ep2_run, reference)
    # each rank built its two of the four experts of the MoE layer, nothing more
    info = json.loads((ep2_run / "run_info.json").read_text())
    assert info["degrees"] == {"dp": 1, "pp": 1, "cp": 2, "ep": 2}
    whole = {n: int(v.size) for n, v in load_grads(reference, 1).items()}
    experts = sum(v for n, v in whole.items() if n.endswith(EXPERTS))
    assert experts > 0
    for rank in info["ranks"]:
        assert rank["params_local"] == sum(whole.values()) - experts // 2


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_dp2_cp2_ep4_matches_one_process(tmp_path: Path, reference: Path) -> None:
    # dp = 2 × micro-batch 1 sees the sequences of dp = 1 × micro-batch 2; the ep group of
    # four spans both dp ranks (one expert per rank, no rank shares one)
    layout = ["parallel.dp=2", "parallel.ep=4", "data.micro_batch_size=1"]
    run = train_launched(CONFIG, tmp_path / "run", 4, [*COMMON, *BALANCE, *layout])
    assert_training_matches(run, reference, steps=STEPS)
    assert_router_matches(run, reference)


@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_pp2_cp2_ep2_dpo_lora_on_experts_matches_one_process(tmp_path: Path) -> None:
    targets = 'lora.target_modules=[".*q_proj",".*k_proj",".*v_proj",".*o_proj",".*mlp[.]experts"]'
    common = [*COMMON, targets, "lora.merge_at_end=true"]
    one = ["parallel.pp=1", "parallel.cp=1", "parallel.pp_layers=null"]
    ref = train_in_process(DPO, tmp_path / "ref", [*common, *one])
    run = train_launched(DPO, tmp_path / "run", 4, [*common, "parallel.ep=2"])
    assert_training_matches(run, ref, steps=STEPS, pp=2, beta=0.1)
    expert_adapters = [n for n in load_grads(ref, 1) if ".mlp.experts." in n]
    assert len(expert_adapters) == 4  # A and B of gate_up_proj and down_proj
    # the adapters are exported whole (gathered from the ep ranks)
    exported = load_file(str(run / "adapters" / "peft_model-00002-of-00002.safetensors"))
    want = load_file(str(ref / "adapters" / "peft_model-00001-of-00001.safetensors"))
    for name in expert_adapters:
        assert exported[name].shape == want[name].shape and want[name].shape[0] == 4
    # the merged export: one shard per (stage, ep rank), every key once, values of a model
    # trained 3 steps in another order (AdamW moves an element by at most ~lr a step)
    got, exp = merged_tensors(run / "merged"), merged_tensors(ref / "merged")
    assert sorted(p.name for p in (run / "merged").glob("model-*.safetensors")) == [
        f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)
    ]
    assert got.keys() == exp.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in exp
    lr_sum = sum(r["lr"] for r in read_metrics(ref))
    for key in exp:
        assert np.max(np.abs(got[key] - exp[key])) <= 2 * lr_sum, key


@pytest.mark.timeout(200)
def test_wrong_expert_offset_fails_the_comparison(
    tmp_path: Path, reference: Path, ep2_run: Path
) -> None:
    out = tmp_path / "bug"
    result = run_launch(
        WORKERS / "ep_bug_train.py",
        2,
        ["--config", str(CONFIG), *COMMON, *BALANCE, f"run.output_dir={out}"],
        timeout=150,
        log_dir=tmp_path / "logs",
    )
    assert result.ok, result.summary()
    with pytest.raises(AssertionError):
        assert_training_matches(out, reference, steps=STEPS)
    # step 1, the comparison's own basis: every expert gradient misses by far, while the
    # correct job's passed (the loss moves little at step 1: freshly initialised experts add
    # a small update to the residual stream)
    want, row = load_grads(reference, 1), read_metrics(reference)[0]
    got = load_grads(out, 1)
    for name in [n for n in want if n.endswith(EXPERTS)]:
        scale = float(np.linalg.norm(want[name]))
        numerics.assert_rejects(got[name], want[name], n=float(row["targets"]), scale=scale,
                                norm="l2", what=name)  # fmt: skip
        numerics.assert_close(load_grads(ep2_run, 1)[name], want[name], n=float(row["targets"]),
                              scale=scale, norm="l2", what=name)  # fmt: skip


@pytest.mark.timeout(240)
def test_ep2_checkpoint_resumes_exactly_and_loads_at_ep1(
    tmp_path: Path, reference: Path, ep2_run: Path
) -> None:
    run = tmp_path / "run"
    ck = [*COMMON, *BALANCE, "checkpoint.every=2"]
    train_launched(CONFIG, run, 2, [*ck, "run.stop_after_steps=2"])
    step2 = run / "checkpoints" / "step_2"
    train_launched(CONFIG, run, 2, ck)
    assert losses(run) == losses(ep2_run)  # 2 + 1 steps == 3 uninterrupted, bitwise
    # the experts are whole in the checkpoint, so it resumes with every expert on one rank
    parts = load_file(str(step2 / "model-00001-of-00001.safetensors"))
    assert parts["model.layers.1.mlp.experts.down_proj"].shape[0] == 4
    single = train_in_process(CONFIG, tmp_path / "one", [*COMMON, *BALANCE, *ONE,
                                                         f"checkpoint.resume={step2}"])  # fmt: skip
    want = read_metrics(reference)[2]
    n, scale = numerics.metric_basis(want, "loss")
    numerics.assert_close(losses(single)[0], want["loss"], n=n, scale=scale, steps=3)


MASTERS = {
    # ZeRO-1 under ep: the replicated parameters sharded over dp × cp = 4, the experts over
    # the 2 ranks holding them (one shard file per rank)
    "zero1": (4, ["parallel.dp=2", "data.micro_batch_size=1", "parallel.shard_optimizer=true"]),
    # bf16 storage: unsharded float32 masters, one file per ep rank (its experts; the first
    # also the replicated parameters)
    "bf16": (2, ["train.param_dtype=bfloat16"]),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(MASTERS))
def test_master_weight_files_under_ep_resume_at_ep1(tmp_path: Path, kind: str) -> None:
    # The shard files cover each expert once, in the full tensors' element coordinates, so the
    # step-2 checkpoint resumes at ep = 1 (another optimizer layout): its step 3 starts from
    # the same parameters as the launched run's step 3 and computes the same loss (the rule).
    nproc, layout = MASTERS[kind]
    dtype = [o for o in layout if o.startswith("train.param_dtype")]
    overrides = [f"train.steps={STEPS}", "checkpoint.every=2", *BALANCE, *layout]
    run = train_launched(CONFIG, tmp_path / "run", nproc, overrides)
    step2 = run / "checkpoints" / "step_2"
    files = sorted(p.name for p in step2.glob("optimizer-*.shard-*.safetensors"))
    assert len(files) == nproc, files
    one = [*COMMON, *BALANCE, *ONE, *dtype]
    first = train_in_process(CONFIG, tmp_path / "one", [*one, "train.steps=1"])
    resumed = train_in_process(CONFIG, tmp_path / "resumed", [*one, f"checkpoint.resume={step2}"])
    rows = read_metrics(run)
    for got, want in ((losses(first)[0], rows[0]), (losses(resumed)[0], rows[2])):
        n, scale = numerics.metric_basis(want, "loss")
        numerics.assert_close(got, want["loss"], n=n, scale=scale, what=f"loss step {want['step']}")


@pytest.mark.timeout(200)
def test_pieces_on_three_ranks(tmp_path: Path) -> None:
    result = run_launch(WORKERS / "ep_worker.py", 3, ["--out", str(tmp_path)], timeout=150)
    assert result.ok, result.summary()
    for rank in range(3):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["links"] == [r for r in range(3) if r != rank]  # gloo pair groups
        assert report["all_to_all"]["sent"] > 0
        layer = report["layer"]
        assert max(layer["units"].values()) <= numerics.FACTOR, layer
        assert min(layer["wrong_units"].values()) > 100 * numerics.FACTOR, layer


@pytest.mark.timeout(200)
def test_bench_moe_ep_bytes_equal_the_counts() -> None:
    [part] = bench.ep_bytes([bench.Case(64, 16, 8)], 2, 0, 150)
    assert [r["rank"] for r in part["ranks"]] == [0, 1]
    for r in part["ranks"]:
        assert r["sent_bytes"] == r["expected_sent_bytes"] > 0
        assert r["received_bytes"] == r["expected_received_bytes"]
        assert r["all_to_all_calls"] == 4  # dispatch and combine, forward and backward
        assert 0.5 < r["sent_bytes"] / r["uniform_bytes"] < 1.5
        assert r["max_rel_diff"] < 1e-5
    assert "all-to-all bytes per rank (ep = 2)" in bench.PAGE.render(
        {**json.loads((ROOT / "docs" / "moe.json").read_text()), "ep_bytes": [part]}
    )
