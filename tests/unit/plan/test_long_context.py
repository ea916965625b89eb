"""The planner's issue-20 side: the host-memory plan and its budget, the longest sequence
that fits, the step-time estimate, `flashcp validate` overrides, and the long-context
mechanisms (offload, residual dtype, tiling, chunked attention, ZeRO-2) as plan items."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashcp import cli, mask_indices, masks
from flashcp.config import load_config
from flashcp.cp.work import mask_pairs
from flashcp.metrics.flops import causal_keys, flops_per_token
from flashcp.plan import GIB, plan
from flashcp.plan.features import AFTER, Features
from flashcp.plan.host import HOST_ITEMS, HOST_PROCESS_BYTES
from flashcp.plan.longest import granularity, longest, with_seq_len
from flashcp.plan.model import ranks_per_node
from flashcp.plan.params import stage_parameters
from flashcp.plan.report import format_plan, format_step_time, host_budget_problems
from flashcp.plan.steptime import estimate, layer_flops
from flashcp.problems import ProblemsError
from helpers.configs import PLANNED, Sections, TinyCfg, merged
from helpers.paths import ROOT

GLM9B = ROOT / "configs/glm/glm4_9b_cp8.yaml"
GLM9B_DPO = ROOT / "configs/glm/glm4_9b_dpo_lora_pp2_cp4.yaml"
AIR_EP = ROOT / "configs/glm/glm45_air_dpo_lora_ep.yaml"


@pytest.fixture
def tiny_base() -> Sections:
    """The planner's tiny GLM, recomputed in full."""
    return merged(PLANNED, model={"recompute": "full"})


def _load(path: Path, *overrides: str) -> Any:
    return load_config(path, list(overrides), allow_placeholders=True)


# -- hardware keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("host_memory_gib", 0),
        ("host_memory_gib", -5),
        ("gpus_per_node", 0),
        ("host_link_gb_per_s", 0),
    ],
)
def test_bad_hardware_values_are_refused_naming_the_key(
    key: str, value: float, tiny_cfg: TinyCfg
) -> None:
    with pytest.raises(ProblemsError) as exc:
        tiny_cfg(hardware={key: value})
    assert [e.key for e in exc.value.problems] == [f"hardware.{key}"]


def test_hardware_defaults_plan_no_host_budget(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg()
    hw = cfg.hardware
    assert (hw.host_memory_gib, hw.gpus_per_node, hw.host_link_gb_per_s) == (None, 8, None)
    p = plan(cfg)
    assert p.host is not None and p.host.budget_bytes is None and p.host.fits


# -- the host plan ------------------------------------------------------------------------------


def test_ranks_per_node_from_the_key_or_the_launch(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(parallel={"dp": 4, "cp": 4})  # 16 ranks
    assert ranks_per_node(cfg) == 8
    assert ranks_per_node(tiny_cfg(parallel={"dp": 4, "cp": 4}, hardware={"gpus_per_node": 4})) == 4
    assert ranks_per_node(cfg, nnodes=4) == 4
    assert ranks_per_node(tiny_cfg(parallel={"cp": 2})) == 2  # a job smaller than a node
    nodes = plan(cfg, device="gpu").host.nodes()  # type: ignore[union-attr]
    assert [x.ranks for x in nodes] == [list(range(0, 8)), list(range(8, 16))]


def test_gpu_host_plan_counts_processes_and_checkpoint_arrays(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(parallel={"cp": 2}, checkpoint={"every": 0})  # the base saves nothing
    host = plan(cfg, device="gpu").host
    assert host is not None
    (node,) = host.nodes()
    assert node.moment == "training step"
    assert node.items == {**dict.fromkeys(HOST_ITEMS, 0), "host_process": 2 * HOST_PROCESS_BYTES}
    assert not any(plan(cfg, device="cpu").host.peak.items.values())  # type: ignore[union-attr]
    last = plan(tiny_cfg(parallel={"cp": 2}, checkpoint={"save_last": True}), device="gpu").host
    assert last is not None and last.peak.moment == "checkpoint save"  # the last step's save
    saving = plan(tiny_cfg(parallel={"cp": 2}, checkpoint={"every": 5}), device="gpu").host
    assert saving is not None
    writer, other = saving.ranks
    params = sum(x.numel for x in stage_parameters(cfg.model)) * 4  # float32 parameters
    moments = 2 * params  # Paddle's AdamW moments, written by the stage writer
    assert writer.moments["checkpoint save"]["checkpoint_arrays"] == max(params, moments)
    assert other.moments["checkpoint save"]["checkpoint_arrays"] == 0
    zero = plan(tiny_cfg(parallel={"cp": 2, "shard_optimizer": True}, checkpoint={"every": 5}),
                device="gpu").host  # fmt: skip
    assert zero is not None
    shard = zero.ranks[1].moments["checkpoint save"]["checkpoint_arrays"]
    assert shard == pytest.approx(12 * params / 4 / 2, rel=1e-3)  # masters + moments ÷ 2


def test_offload_moves_each_layers_input_to_host(tiny_cfg: TinyCfg) -> None:
    """Independent count: every layer's input (the stage input and the outputs of all but the
    last layer), T·H elements in the residual dtype, per in-flight micro-batch."""
    cfg = tiny_cfg(parallel={"cp": 2}, data={"seq_len": 256, "micro_batch_size": 2})
    args = cfg.model
    tokens = 2 * 256 // 2
    for residual, size in (("float32", 4), ("bfloat16", 2)):
        f = Features(offload_activations=True, residual_dtype=residual)
        base = plan(cfg, features=Features(residual_dtype=residual))
        moved = plan(cfg, features=f)
        host = moved.host.ranks[0].moments["training step"]  # type: ignore[union-attr]
        expected = args.num_layers * tokens * args.hidden_size * size
        assert host["offloaded_activations"] == expected
        before = base.ranks[0].moments["forward: loss"]["activations"]
        after = moved.ranks[0].moments["forward: loss"]["activations"]
        assert before - after == expected  # what left the device is what the host holds
    # on a GPU each copy is its own pinned buffer: the same bytes, plus the process
    gpu = plan(cfg, device="gpu", features=Features(offload_activations=True))
    step = gpu.host.ranks[0].moments["training step"]  # type: ignore[union-attr]
    assert step == {"offloaded_activations": args.num_layers * tokens * args.hidden_size * 4,
                    "checkpoint_arrays": 0, "host_process": HOST_PROCESS_BYTES}  # fmt: skip


def test_offload_keeps_every_in_flight_micro_batch_on_host(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(parallel={"pp": 2}, train={"grad_accum": 4}, model={"num_layers": 4})
    p = plan(cfg, features=Features(offload_activations=True))
    per_layer = 128 * cfg.model.hidden_size * 4
    stash = [r.moments["training step"]["offloaded_activations"] for r in p.host.ranks]  # type: ignore[union-attr]
    assert stash == [2 * 2 * per_layer, 1 * 2 * per_layer]  # 1F1B: pp - stage in flight


def test_offload_and_tiling_need_recompute(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(model={"recompute": "none"})
    for f in (Features(offload_activations=True), Features(tile_tokens=16)):
        with pytest.raises(ValueError, match="model.recompute"):
            plan(cfg, features=f)


def test_host_budget_refused_naming_node_item_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["data.seq_len=1048576", "model.max_seq_len=1048576", "train.grad_accum=1",
                 "hardware.host_memory_gib=500"]  # fmt: skip
    cfg = _load(GLM9B, *overrides)
    fits = plan(cfg)
    assert fits.host_fits and host_budget_problems(fits) == []  # no offload: processes only
    p = plan(cfg, features=AFTER.with_(residual_dtype="float32"))
    assert not p.host_fits and not p.fits and p.device_fits
    (problem,) = host_budget_problems(p)
    message = problem.problem
    assert problem.key == "hardware.host_memory_gib"
    assert "per node" in message and "node 0 (ranks 0-7, 8 per node)" in message
    assert "offloaded_activations" in message and "--longest" in message
    text = format_plan(p, cfg)
    assert "host memory (8 ranks per node)" in text and "DOES NOT FIT" in text
    # the same budget through `flashcp validate` and the pre-launch check (no offload key
    # exists yet: a budget below the processes' own memory is refused the same way)
    small = ["hardware.host_memory_gib=10"]
    assert cli.main(["validate", str(GLM9B), *small]) == 2
    out = capsys.readouterr().out
    assert "FAIL" in out and ": hardware.host_memory_gib: the host memory plan exceeds" in out
    assert "checkpoint_arrays" in out and "hardware.memory_gib" not in out.split("host_memory")[0]
    assert cli.main(["validate", str(GLM9B), "hardware.host_memory_gib=1000"]) == 0
    node = plan(_load(GLM9B)).host.peak.total_bytes / GIB  # type: ignore[union-attr]
    assert f"host {node:.1f} of 1000 GiB per node" in capsys.readouterr().out
    # `--nnodes` is the launch's split: 4 ranks per node halve a node's host plan
    assert cli.main(["validate", str(GLM9B), "--nnodes", "2", "hardware.host_memory_gib=1000"]) == 0
    halved = plan(_load(GLM9B), nnodes=2).host.peak.total_bytes / GIB  # type: ignore[union-attr]
    assert halved < node and f"host {halved:.1f} of 1000" in capsys.readouterr().out

    from flashcp.launch import job, preflight
    from flashcp.preflight import memory_problems

    out_dir = tmp_path / "run"
    tiny = ROOT / "configs/gpt/tiny_cp2.yaml"
    over = ["hardware.host_memory_gib=1e-9", "run.device=cpu", f"run.output_dir={out_dir}"]
    # CPU plans count no process memory: without checkpoints nothing is outside the allocator
    assert memory_problems(load_config(tiny, [*over, "checkpoint.every=0",
                                              "checkpoint.save_last=false"])) == []  # fmt: skip
    (problem,) = memory_problems(load_config(tiny, [*over, "checkpoint.every=5"]))
    assert "checkpoint_arrays" in problem.message
    big = load_config(GLM9B, [*small, f"run.output_dir={out_dir}"], allow_placeholders=True)
    (problem,) = memory_problems(big)
    assert "hardware.host_memory_gib=null" in problem.message
    code = job.run_job(big, GLM9B, small, out=io.StringIO())
    assert code == preflight.EXIT_PREFLIGHT and not out_dir.exists()


def test_validate_takes_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "configs/glm/tiny_cp2.yaml")
    assert cli.main(["validate", config, "train.steps=7"]) == 0
    assert "1 of 1 config(s) valid" in capsys.readouterr().out
    assert cli.main(["validate", config, "parallel.cp=3"]) == 2  # 256 % (2·3) != 0
    out = capsys.readouterr().out
    assert "FAIL" in out and "data.seq_len" in out and "parallel.cp 3" in out
    assert cli.main(["validate", config, "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().out


# -- the longest sequence -----------------------------------------------------------------------


def _linear_longest(cfg: Any, step: int, budget: float, features: Features) -> int:
    """Reference: the first multiple of `step` that does not fit, by plain scanning."""
    n = step
    while plan(with_seq_len(cfg, n), budget_gib=budget, features=features).fits:
        n += step
    return n - step


@pytest.mark.parametrize("features", [Features(), Features(offload_activations=True)])
def test_longest_equals_a_linear_scan(features: Features, tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(parallel={"cp": 2}, model={"preset": "tiny_glm", "recompute": "full",
                                              "max_seq_len": 256})  # fmt: skip
    step = granularity(cfg)
    assert step == 4  # cp 2 × 2 chunks per rank (dual-chunk)
    budget = plan(with_seq_len(cfg, 3000), features=features).peak.total_bytes / GIB
    found = longest(cfg, budget_gib=budget, features=features)
    assert found.seq_len == _linear_longest(cfg, step, budget, features)
    assert found.seq_len % step == 0 and found.plan is not None and found.plan.fits
    assert found.next_plan is not None and not found.next_plan.fits
    assert found.limit == "device" and found.plans < 30
    assert "raised to" in found.assumed["model.max_seq_len"]  # rotary: the limit moves


def test_longest_respects_the_host_budget_and_learned_positions(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(parallel={"cp": 2}, hardware={"host_memory_reserve": 0})
    f = Features(offload_activations=True)
    host = plan(with_seq_len(cfg, 2000), features=f, device="gpu")
    host_gib = host.host.peak.total_bytes / GIB  # type: ignore[union-attr]
    found = longest(cfg, device="gpu", budget_gib=10_000, host_budget_gib=host_gib, features=f)
    assert found.limit == "host" and 1900 < found.seq_len <= 2000
    learned = tiny_cfg(model={"preset": "tiny", "position": "learned", "max_seq_len": 512})
    capped = longest(learned, budget_gib=10_000)
    assert capped.seq_len == 512 and capped.limit == "max_seq_len"
    with pytest.raises(ValueError, match="hardware.memory_gib"):
        longest(cfg)  # no device budget
    nothing = longest(cfg, budget_gib=1e-6)
    assert nothing.seq_len == 0 and nothing.plan is None


def test_longest_leaves_the_stated_margins(
    tiny_cfg: TinyCfg, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--longest` answers keep hardware.memory_headroom of the device budget and
    hardware.host_memory_reserve of the host's free: the answer's peaks are within the
    budgets less their margins and one granule more is not. Negative control: the answer
    without the margins is longer, and its peaks eat into them."""
    f = Features(offload_activations=True)
    base = tiny_cfg(parallel={"cp": 2})
    gib = plan(with_seq_len(base, 3000), features=f).peak.total_bytes / GIB
    cfg = tiny_cfg(parallel={"cp": 2}, hardware={"memory_gib": gib, "memory_headroom": 0.2})
    found = longest(cfg, features=f)
    assert found.plan is not None and found.next_plan is not None and found.limit == "device"
    assert found.plan.peak.total_bytes <= 0.8 * gib * GIB < found.next_plan.peak.total_bytes
    assert found.plan.margin_bytes is not None and found.plan.margin_bytes >= 0
    assert found.without_margins is not None and found.without_margins > found.seq_len
    assert found.without_margins == longest(cfg, features=f, margins=False).seq_len
    full = plan(with_seq_len(cfg, found.without_margins), features=f)
    assert 0.8 * gib * GIB < full.peak.total_bytes <= gib * GIB  # the margin, used up
    assert (
        full.fits is False
        and plan(with_seq_len(cfg, found.without_margins), features=f, margins=False).fits
    )
    # the host side: a node's planned host memory within the budget less its reserve
    host_gib = plan(with_seq_len(base, 3000), features=f).host.peak.total_bytes
    host_gib /= GIB  # type: ignore[union-attr]
    roomy = tiny_cfg(parallel={"cp": 2}, hardware={
        "memory_gib": 10_000, "host_memory_gib": host_gib * 2, "host_memory_reserve": 0.5,
    })  # fmt: skip
    held = longest(roomy, features=f)
    assert held.limit == "host" and held.plan is not None and held.plan.host is not None
    assert held.plan.host.peak.total_bytes <= host_gib * GIB
    assert held.without_margins is not None and held.without_margins > held.seq_len
    # the CLI gives both answers
    path = ROOT / "configs/glm/tiny_cp2.yaml"
    over = [f"hardware.memory_gib={gib}", "hardware.memory_headroom=0.2", "model.recompute=full",
            "train.offload_activations=true"]  # fmt: skip
    assert cli.main(["plan", str(path), *over, "--longest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["without_margins_seq_len"] > out["longest_seq_len"] > 0
    assert out["assumed"]["hardware.memory_headroom"] == 0.2
    usable = out["plan"]["usable_budget_bytes"]
    assert usable == int(gib * GIB * 0.8) >= max(r["total_bytes"] for r in out["plan"]["ranks"])


def test_longest_without_margins_when_only_the_host_reserve_is_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`flashcp plan --longest` with hardware.memory_headroom 0 and only
    hardware.host_memory_reserve kept: the answer still says what fits without the margins
    (the host's reserve used up). The control: with both margins 0 there is no second
    answer."""
    path = str(ROOT / "configs/glm/tiny_cp2.yaml")
    over = ["model.recompute=full", "train.offload_activations=true", "model.max_seq_len=3000"]
    assert cli.main(["plan", path, *over, "data.seq_len=3000", "--json"]) == 0
    host_bytes = json.loads(capsys.readouterr().out)["host"]["nodes"][0]["total_bytes"]
    budgets = ["hardware.memory_gib=10000", "hardware.memory_headroom=0",
               f"hardware.host_memory_gib={2 * host_bytes / GIB}"]  # fmt: skip
    answers = {}
    for reserve in (0.5, 0):
        args = [*over, *budgets, f"hardware.host_memory_reserve={reserve}"]
        assert cli.main(["plan", path, *args, "--longest", "--json"]) == 0
        answers[reserve] = out = json.loads(capsys.readouterr().out)
        assert out["limit"]["budget"] == "host"
        assert out["assumed"]["hardware.memory_headroom"] == 0
        assert out["assumed"]["hardware.host_memory_reserve"] == reserve
    kept, none = answers[0.5], answers[0]
    assert 0 < kept["longest_seq_len"] <= 3000 < kept["without_margins_seq_len"]
    assert kept["without_margins_seq_len"] == none["longest_seq_len"]
    assert none["without_margins_seq_len"] is None


def test_validate_and_train_fit_the_budget_less_its_headroom(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config whose peak fits the device memory but not the memory less its headroom is
    refused by `flashcp validate` and by `flashcp train`'s preflight, naming
    hardware.memory_headroom; with memory_headroom=0 both accept it (the control)."""
    from flashcp.preflight import memory_problems

    peak = plan(_load(GLM9B)).peak.total_bytes / GIB
    budget = f"hardware.memory_gib={peak / 0.97:.3f}"  # 3 % above the peak: < 5 % headroom
    assert cli.main(["validate", str(GLM9B), budget]) == 2
    out = capsys.readouterr().out
    assert "FAIL" in out and "less 5 % hardware.memory_headroom" in out
    assert cli.main(["validate", str(GLM9B), budget, "hardware.memory_headroom=0"]) == 0
    assert "planned peak" in capsys.readouterr().out
    run = [f"run.output_dir={tmp_path / 'run'}", budget]
    (problem,) = memory_problems(_load(GLM9B, *run))
    assert "hardware.memory_headroom" in problem.message
    assert memory_problems(_load(GLM9B, *run, "hardware.memory_headroom=0")) == []
    for bad in ("1", "-0.1", "1.5"):
        assert cli.main(["validate", str(GLM9B), f"hardware.memory_headroom={bad}"]) == 2
        assert "hardware.memory_headroom: must be a fraction in [0, 1)" in capsys.readouterr().out


def test_granularity_is_the_layouts(tiny_cfg: TinyCfg) -> None:
    assert granularity(tiny_cfg(parallel={"cp": 4})) == 8  # dual-chunk: 2 chunks per rank
    assert granularity(tiny_cfg(parallel={"cp": 4, "cp_mode": "contiguous_allgather"})) == 4
    assert granularity(tiny_cfg(parallel={"cp": 4, "cp_mode": "workload_balanced"})) == 16
    # tiles and attention chunks need not divide the sequence: a tile that does not divide
    # the local tokens plans like one that does, and the search is unchanged
    cfg = tiny_cfg(parallel={"cp": 2}, data={"seq_len": 200})
    odd = plan(cfg, features=Features(offload_activations=True, tile_tokens=30)).peak
    assert odd.total_bytes > 0


def test_longest_glm_configs_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    answers = {}
    for path in (GLM9B, GLM9B_DPO, AIR_EP):
        answers[path] = found = longest(_load(path))
        assert found.seq_len > 0 and found.limit == "device"
    assert cli.main(["plan", str(GLM9B), "--longest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["longest_seq_len"] == answers[GLM9B].seq_len
    assert out["granularity"] == 16 and out["limit"]["budget"] == "device"
    assert out["plan"]["fits"] and out["step_time"]["flops_per_step"] > 0
    assert cli.main(["plan", str(GLM9B), "--longest", "hardware.memory_gib=null"]) == 2
    assert "hardware.memory_gib" in capsys.readouterr().err
    assert cli.main(["plan", str(GLM9B), "--longest"]) == 0
    text = capsys.readouterr().out
    assert "longest data.seq_len" in text and "does not fit the device budget" in text


# -- the step time --------------------------------------------------------------------------------


def attended_keys(m: masks.Mask) -> float:
    """Keys a query attends on average under `m`: its visible pairs (`mask_pairs`) per query."""
    return float(mask_pairs(m.indices, causal=m.causal).mean() / m.indices.shape[2])


def test_causal_keys_count_what_the_mask_computes() -> None:
    """`mask_pairs` against the dense oracle (`mask_indices.to_dense`), and causal = (S+1)/2."""
    cases = [
        masks.causal_mask(2, 300),
        masks.causal_document_mask([100, 150, 50], batch=2),
        masks.sliding_window_mask(1, 300, 40),
        masks.share_question_mask([(40, 20, 30), (100, 60, 50)], 300),
    ]
    for m in cases:
        dense = mask_indices.to_dense(m.indices, causal=m.causal)  # True = masked
        want = float((~dense).sum(axis=(-1, -2)).mean() / dense.shape[-1])
        assert attended_keys(m) == pytest.approx(want, rel=1e-12)
    causal = masks.causal_mask(1, 300)
    assert attended_keys(causal) == causal_keys(300) == 150.5
    assert attended_keys(causal.noncausal()) == 150.5  # the same mask, 2 columns
    # negative control: bidirectional documents attend their whole document
    both = masks.document_mask([100, 200])
    assert attended_keys(both) == (100 * 100 + 200 * 200) / 300


def test_step_time_is_the_mfu_formula_with_causal_attention() -> None:
    cfg = _load(GLM9B, "hardware.peak_tflops=148", "train.grad_accum=2")
    est = estimate(cfg, mfu=0.5)
    seq = cfg.data.seq_len
    per_token = flops_per_token(cfg.model, seq, keys=(seq + 1) / 2)
    assert est.flops == pytest.approx(per_token * 2 * seq)
    assert est.flops < flops_per_token(cfg.model, seq) * 2 * seq  # full attention counts more
    assert est.seconds_at_peak == pytest.approx(est.flops / 8 / 148e12)
    assert est.seconds == pytest.approx(est.seconds_at_peak / 0.5)
    assert est.copy_hidden is None  # no offload
    # layer_flops is the per-layer forward part of the same formula: training is 3 forwards
    # (w = 6, a = 12) of the layers plus the LM head's 2·V·H
    layers = sum(layer_flops(cfg.model, i, 1, (seq + 1) / 2) for i in range(40))
    head = 2 * cfg.model.vocab_size * cfg.model.hidden_size
    assert 3 * (layers + head) == pytest.approx(per_token, rel=1e-12)


@pytest.mark.parametrize(
    ("attention", "keys"),
    [
        (["attention.mask=sliding_window", "attention.sliding_window=4096"],
         lambda s: (4096 * 4097 / 2 + (s - 4096) * 4096) / s),
        (["attention.mask=global_window", "attention.sliding_window=4096",
          "attention.global_tokens=4"],
         lambda s: (4096 * 4097 / 2 + (s - 4096) * 4096 + 4 * (s - 4096) - 6) / s),
        (["attention.mask=prefix_lm"], lambda s: (s + 1) / 2),  # sft prompts: unknown, causal
    ],
)  # fmt: skip
def test_step_time_counts_the_runs_mask(attention: list[str], keys: Any) -> None:
    """`attention.mask`: the estimate counts the keys a query of one data.seq_len document
    sees under it (a 4096 window at 32K tokens: 1/8 of causal's), and says which mask."""
    cfg = _load(GLM9B, "hardware.peak_tflops=148", *attention)
    seq = cfg.data.seq_len
    tokens = cfg.parallel.dp * cfg.train.grad_accum * cfg.data.micro_batch_size * seq
    est = estimate(cfg, mfu=0.5)
    assert est.flops == pytest.approx(flops_per_token(cfg.model, seq, keys=keys(seq)) * tokens)
    assert f"({est.mask} attention)" in format_step_time(est)
    if "prefix_lm" not in est.mask:
        assert est.flops < estimate(_load(GLM9B, "hardware.peak_tflops=148")).flops


@pytest.mark.parametrize(
    "overrides", [(), ("parallel.pp=2", "train.grad_accum=4", "parallel.pp_layers=null")]
)
def test_step_time_parts_add_up_to_the_step(overrides: tuple[str, ...]) -> None:
    """One basis: the busiest stage's parts (layers, head), per micro-batch, add up to the
    stage's compute and, with one stage, to the step; their model FLOPs over every rank add up
    to the `mfu` metric's count, their executed FLOPs to the executed total. The step is the
    model FLOPs per device at peak × MFU (pp = 1)."""
    cfg = _load(GLM9B, "hardware.peak_tflops=148", *overrides)
    est = estimate(cfg, mfu=0.4)
    micro, ranks = cfg.train.grad_accum, cfg.parallel.dp * cfg.parallel.cp
    parts_s = micro * sum(x.forward_s + x.backward_s for x in est.parts)
    assert parts_s == pytest.approx(est.compute_s, rel=1e-12)
    from flashcp.plan.report import _duration, format_step_time

    assert f"= {_duration(parts_s)} of compute" in format_step_time(est)
    seq = cfg.data.seq_len
    tokens = cfg.parallel.dp * micro * seq
    assert est.flops == pytest.approx(flops_per_token(cfg.model, seq, keys=(seq + 1) / 2)
                                      * tokens, rel=1e-12)  # fmt: skip
    assert est.executed == pytest.approx(sum(est.stage_executed) * ranks, rel=1e-12)
    if cfg.parallel.pp == 1:
        assert sum(x.model_flops for x in est.parts) * micro * ranks == pytest.approx(est.flops)
        assert est.seconds == pytest.approx(parts_s, rel=1e-12)
        assert est.seconds == pytest.approx(est.flops / 8 / (148e12 * 0.4), rel=1e-12)
        assert est.hfu == pytest.approx(0.4 * est.executed / est.flops)
    else:  # the busiest stage sets the pace, the bubble stretches it
        assert est.seconds == pytest.approx(parts_s / (1 - est.bubble), rel=1e-12)
        assert est.seconds > est.flops / est.devices / (148e12 * 0.4)


def test_executed_flops_count_recompute_tiles_and_the_attention_backward() -> None:
    """Independent count for one layer and the head of GLM-4-9B's full fine-tune at 4M tokens
    (full recompute, tiles, chunked loss): forward F, backward 2 F for the matmuls and 2.5 F
    for attention, recompute's F again, tiling's third matmul forward, the chunked loss's
    head again. Executed ≈ 1.5× the model FLOPs at 4M, where attention is nearly all of it."""
    cfg = _load(ROOT / "configs/glm/glm4_9b_sft_4m_cp8.yaml")
    est = estimate(cfg)
    args, T, S = cfg.model, cfg.data.seq_len // 8, cfg.data.seq_len
    h, q, kv, i = args.hidden_size, args.num_heads * args.head_size, 256, args.intermediate_size
    w = h * (q + 2 * kv) + q * h + 3 * h * i
    mm, att = 2 * w * T, 4 * q * T * (S + 1) / 2
    layer = est.parts[0]
    assert layer.forward_flops == pytest.approx(mm + att, rel=1e-12)
    assert layer.backward_flops == pytest.approx(2 * mm + 2.5 * att + (mm + att) + mm, rel=1e-12)
    assert layer.model_flops == pytest.approx(3 * mm + 3 * att, rel=1e-12)
    head = est.parts[-1]
    f_head = 2 * args.vocab_size * h * T
    assert head.name == "head" and head.backward_flops == pytest.approx(3 * f_head, rel=1e-12)
    assert 1.45 < est.executed_over_model < 1.55
    # negative control: without recompute and tiling the backward is 2 F + 2.5 F
    plain = estimate(_load(GLM9B, "model.recompute=none")).parts[0]
    assert plain.backward_flops / plain.forward_flops < layer.backward_flops / layer.forward_flops


def test_document_structure_sets_the_attention_work(tmp_path: Path) -> None:
    """Packed documents attend within themselves: `DocumentMix` counts each packed row's
    visible pairs as the mask of that row does (`mask_pairs` of its causal-document mask);
    documents longer than the row are cut. `--docs` takes lengths from a file or a data
    sample, and the step it estimates is a fraction of one 4M-token document's."""
    from flashcp.plan.documents import DocumentMix, keys_per_token

    row = 1000
    mix = DocumentMix(np.array([300, 500, 200, 700, 300]))
    # the sample laid end to end, cut at 1000: rows [300, 500, 200], [700, 300]
    pieces = [[300, 500, 200], [700, 300]]
    want = np.mean([attended_keys(masks.causal_document_mask(p)) for p in pieces])
    got = mix.keys_per_token(row)
    assert got == pytest.approx(want, rel=0.15)  # the shuffled order packs alike on average
    long = DocumentMix(np.array([5000]))
    assert long.keys_per_token(row) == causal_keys(row)  # cut into whole rows
    assert keys_per_token(None, row) == causal_keys(row)
    # under a mask family each packed piece is counted as that mask builds it: a 100-key
    # window over rows cut from one long document is the window mask's count of one row
    window = masks.DocumentMasking("sliding_window", 100)
    assert long.keys_per_token(row, window) == attended_keys(window.build([[row]]))
    assert keys_per_token(None, row, window) == long.keys_per_token(row, window)
    assert mix.keys_per_token(row, window) < got  # and the window is cheaper than causal
    cfg = _load(ROOT / "configs/glm/glm4_9b_sft_4m_cp8.yaml")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text(" ".join(["4096"] * 2048))
    from flashcp.plan.documents import read_lengths

    packed = estimate(cfg, docs=read_lengths(lengths))
    assert packed.keys == pytest.approx(4097 / 2, rel=1e-6)
    assert packed.seconds < estimate(cfg).seconds / 50  # type: ignore[operator]
    assert cli.main(["plan", str(ROOT / "configs/glm/tiny_cp2.yaml"), "--json",
                     "--docs", str(lengths)]) == 0  # fmt: skip
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": "x" * n}) for n in (10, 50, 90)) + "\n")
    from flashcp.plan.documents import load_documents

    sample = load_documents(str(data), _load(ROOT / "configs/glm/tiny_cp2.yaml"))
    assert sorted(sample.lengths.tolist()) == [12, 52, 92]  # bytes + BOS + EOS
    with pytest.raises(ValueError, match="not a built-in mix"):
        load_documents(str(tmp_path / "missing"), cfg)


def test_document_sources(tmp_path: Path) -> None:
    """`--docs` sources: a JSON list, a `flashcp data-stats --json` report (its rows'
    segments), DPO preference pairs (whole examples with their share-question pairs, fewer
    than causal), a built-in mix; bad input is refused naming the file."""
    from flashcp.plan.documents import load_documents, mix, read_lengths

    listed = tmp_path / "lengths.json"
    listed.write_text("[100, 300]")
    assert read_lengths(listed).lengths.tolist() == [100, 300]
    report = tmp_path / "stats.json"
    report.write_text(json.dumps({"steps": [{"ranks": [{"micro_batches": [
        {"rows": [[10, 20], [30]]}]}]}]}))  # fmt: skip
    assert read_lengths(report).lengths.tolist() == [10, 20, 30]
    for bad, text in ((listed, '{"a": 1}'), (tmp_path / "x.txt", "12 twelve")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=str(bad.name)):
            read_lengths(bad)
    dpo_cfg = _load(ROOT / "configs/glm/tiny_dpo_lora_cp2.yaml")
    pairs = load_documents(str(ROOT / "src/flashcp/data/dpo_default.jsonl"), dpo_cfg)
    assert pairs.pairs is not None and len(pairs.pairs) == len(pairs.lengths)
    causal = load_documents(str(ROOT / "src/flashcp/data/dpo_default.jsonl"), dpo_cfg)
    object.__setattr__(causal, "pairs", None)  # the same examples as causal documents
    row = dpo_cfg.data.seq_len
    assert pairs.keys_per_token(row) < causal.keys_per_token(row)
    assert load_documents("chat", dpo_cfg).name.startswith("chat mix")
    with pytest.raises(ValueError, match="unknown document mix"):
        mix("nope")


def test_offload_copies_against_the_host_link() -> None:
    cfg = _load(GLM9B, "hardware.peak_tflops=148", "hardware.host_link_gb_per_s=32")
    f = Features(offload_activations=True, residual_dtype="bfloat16")
    est = estimate(cfg, features=f)
    layer = est.layers[0]
    assert layer.copy_bytes == 32768 // 8 * 4096 * 2  # T·H in bf16
    assert layer.copy_s == pytest.approx(layer.copy_bytes / 32e9)
    assert est.copy_hidden is True and est.stall_s == 0
    slow = estimate(cfg, features=f, link_gb_per_s=1e-3)  # negative control: a slow link stalls
    assert slow.copy_hidden is False and slow.stall_s > 0
    assert slow.seconds > est.seconds  # type: ignore[operator]
    from flashcp.plan.report import format_step_time

    assert "STALLS" in format_step_time(slow)
    assert "hidden under the compute" in format_step_time(est)


def test_offload_stall_counts_the_copy_back_in_the_backward(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`flashcp plan --json`: each offloaded layer input goes to host during the layer's
    forward and comes back during the backward of the layer above; on a link slow enough
    that a copy outlasts both, the step stalls by (copy − forward) + (copy − backward) per
    layer and micro-batch — the host→device copy counted, not only the device→host one."""
    link = 0.5  # GB/s: a 64 MiB copy (0.13 s) outlasts a layer's forward and its backward
    over = ["train.offload_activations=true", "hardware.peak_tflops=148",
            f"hardware.host_link_gb_per_s={link}"]  # fmt: skip
    cfg = _load(GLM9B, *over)
    assert cli.main(["plan", str(GLM9B), *over, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["step_time"]
    copy_s = st["layer"]["copy_bytes"] / (link * 1e9)
    layers = [x for x in st["parts"] if x["name"].startswith("layer ")]
    assert len(layers) == cfg.model.num_layers
    assert all(x["forward_s"] < x["backward_s"] < copy_s for x in layers)
    one_way = sum(copy_s - x["forward_s"] for x in layers)  # device→host only
    both = sum((copy_s - x["forward_s"]) + (copy_s - x["backward_s"]) for x in layers)
    micro = cfg.train.grad_accum
    assert st["offload_stall_s"] == pytest.approx(micro * both, rel=1e-12)
    assert st["offload_stall_s"] > micro * one_way * 1.2  # the way back: a fifth more here
    assert st["copy_hidden"] is False


# -- the mechanisms as plan items ------------------------------------------------------------------


def test_no_mechanism_means_todays_plan() -> None:
    for path in (GLM9B, GLM9B_DPO, AIR_EP, ROOT / "configs/glm/tiny_moe_ep2_cp2.yaml"):
        cfg = _load(path)
        assert plan(cfg, features=Features()).to_json() == plan(cfg).to_json()


def test_bf16_residual_halves_the_kept_inputs() -> None:
    """Between layers the stream is bf16 (kept inputs, offloaded bytes, stage transfers);
    inside a layer it is upcast to float32 (`flashcp.models.base._bind`)."""
    cfg = _load(GLM9B, "parallel.pp=2", "train.grad_accum=2")
    f = Features(offload_activations=True)
    f32 = plan(cfg, features=f)
    bf16 = plan(cfg, features=f.with_(residual_dtype="bfloat16"))
    step = [p.host.ranks[0].moments["training step"]["offloaded_activations"]  # type: ignore[union-attr]
            for p in (f32, bf16)]  # fmt: skip
    assert step[1] * 2 == step[0]
    p2p = [p.ranks[0].moments["backward: layer"]["p2p_buffers"] for p in (f32, bf16)]
    assert p2p[1] * 2 == p2p[0]


def test_tiling_bounds_the_layer_working_set() -> None:
    cfg = _load(GLM9B, "data.seq_len=524288", "model.max_seq_len=524288", "train.grad_accum=1")

    def work(tile: int) -> int:
        f = Features(offload_activations=True, tile_tokens=tile)
        return plan(cfg, features=f).ranks[0].moments["backward: layer"]["layer_working_set"]

    untiled = plan(cfg, features=Features(offload_activations=True))
    full = untiled.ranks[0].moments["backward: layer"]["layer_working_set"]
    sizes = [work(n) for n in (1024, 4096, 16384)]
    assert sizes == sorted(sizes) and sizes[-1] < full
    # the MLP's intermediates (4·I per token, bf16) of one tile, not of the 64K local tokens
    mlp = 4 * cfg.model.intermediate_size * 2
    assert full - sizes[0] > (65536 - 1024) * mlp


def test_chunked_attention_bounds_the_kv_gather() -> None:
    from flashcp.plan.attention_scratch import attention_backward_bytes
    from flashcp.plan.counts import Dtypes

    args = _load(GLM9B).model
    dt = Dtypes.of("bfloat16", "bfloat16", "gpu", "bfloat16")
    kv, q = args.num_kv_heads * args.head_size, args.num_heads * args.head_size
    T, S = 131072, 1048576
    whole = attention_backward_bytes(args, dt, T, S, cp=True)
    assert whole.kv_gather == S * kv * (2 * 2 + 4 * 4)  # K, V in bf16 + 4 float32 [S, kv]
    chunked = attention_backward_bytes(args, dt, T, S, cp=True, query_chunk=8192, kv_chunk=65536)
    # one key chunk's K, V and one call's dK, dV (bf16), its float32 sums and scatter parts,
    # and the local full-length dK, dV (bf16) the chunks' reduce-scatters fill
    assert chunked.kv_gather == 65536 * kv * (2 * 2 + 2 * 2 + 4 * 4) + 2 * T * kv * 2
    # dO (bf16) and dQ summed over key chunks (float32) stay full-length; the kernel's
    # scratch (3·q bf16; on the GPU the float32 dQ accumulator and D of one query chunk, and
    # FA2's dK/dV expanded to the 32 query heads for one key chunk) is per call; at the end
    # dQ's float32 sum and its bf16 cast coexist
    expanded = 2 * 65536 * q * 2
    assert chunked.scratch == 8192 * (q + 32) * 4 + expanded
    assert chunked.transient == max(
        T * q * (2 + 4 + 2), T * q * (2 + 4) + 8192 * (3 * q * 2 + (q + 32) * 4) + expanded
    )
    assert whole.transient == T * (5 * q * 2 + (q + 32) * 4) + 2 * S * q * 2
    cfg = _load(GLM9B, "data.seq_len=1048576", "model.max_seq_len=1048576",
                "train.grad_accum=1")  # fmt: skip
    f = Features(offload_activations=True, tile_tokens=4096)
    peaks = [plan(cfg, features=g).peak.total_bytes
             for g in (f, f.with_(query_chunk=8192, kv_chunk=65536))]  # fmt: skip
    assert peaks[1] < peaks[0]


def test_chunked_attention_backward_matches_the_allocator() -> None:
    """The chunked attention backward (`flashcp.attention.allgather_kv_chunked`) allocates
    the local full-length dK and dV when it starts and fills them chunk by chunk: measured
    with Paddle's allocator in one process (one rank: the gathers are the local rows), its
    peak is within 15 % of `attention_backward_bytes` (the incoming dO, allocated before,
    taken out). Negative control: the plan without the local dK/dV is more than 15 % short."""
    import paddle

    from flashcp.attention import registry
    from flashcp.attention.context import AttentionContext
    from flashcp.metrics.memory import PeakMeter
    from flashcp.models import preset
    from flashcp.plan.attention_scratch import attention_backward_bytes
    from flashcp.plan.counts import Dtypes

    args = preset("small_glm")
    T, hq, hkv, d = 4096, args.num_heads, args.num_kv_heads, args.head_size
    rng = np.random.default_rng(0)

    def tensor(heads: int) -> Any:
        x = rng.standard_normal((1, T, heads, d)).astype(np.float32)
        return paddle.to_tensor(x, stop_gradient=False)

    q, k, v, dout = tensor(hq), tensor(hkv), tensor(hkv), tensor(hq)
    mask = masks.causal_mask(1, T)
    ctx = AttentionContext(mask=mask.indices, causal=True, query_chunk=512, kv_chunk=1024)
    impl = registry.implementation_for(ctx)
    plan_ = ctx.plan(impl, q, k, v)
    out, lse = impl.apply_with_lse(q, k, v, plan_)
    with PeakMeter() as meter:
        grads = impl.backward(q, k, v, out, lse, dout, plan_)
    del grads
    cost = attention_backward_bytes(args, Dtypes.of("float32", "float32"), T, T, cp=True,
                                    query_chunk=512, kv_chunk=1024)  # fmt: skip
    planned = cost.transient + cost.kv_gather - T * hq * d * 4  # dO was there before
    assert abs(meter.peak_bytes / planned - 1) <= 0.15, (meter.peak_bytes, planned)
    without = planned - 2 * T * hkv * d * 4
    assert meter.peak_bytes / without - 1 > 0.15, (meter.peak_bytes, without)


def test_attention_backward_scratch_is_paddles_kernels() -> None:
    """`kernel_backward_scratch`, counted independently from Paddle's grad kernels
    (paddle/phi/kernels/gpu/flash_attn_grad_kernel.cu, flash_attn_v3_grad_kernel.cu): FA2
    expands dK/dV to the query heads for grouped KV heads, `[keys, Hq, d]` each in bf16;
    FA3 keeps float32 accumulators at the KV heads. The larger one counts: FA2's at GLM-4-9B's
    32/2 heads (1 GiB per 65,536 keys), FA3's rows without grouped heads, nothing on CPU."""
    from flashcp.plan.attention_scratch import kernel_backward_scratch
    from flashcp.plan.counts import Dtypes

    args = _load(GLM9B).model
    gpu = Dtypes.of("bfloat16", "bfloat16", "gpu", "bfloat16")
    rows, keys = 8192, 65536
    fa2 = rows * (32 * 128 + 32) * 4 + 2 * keys * 32 * 128 * 2
    fa3 = rows * (32 * 128 + 64) * 4 + 2 * keys * 2 * 128 * 4
    assert kernel_backward_scratch(args, gpu, rows, keys) == fa2 > fa3
    assert 2 * keys * 32 * 128 * 2 == GIB
    mha = dataclasses.replace(args, num_kv_heads=32)  # no grouped heads: no expansion
    assert kernel_backward_scratch(mha, gpu, rows, keys) == rows * (32 * 128 + 64) * 4
    assert kernel_backward_scratch(args, Dtypes.of("float32", "float32"), rows, keys) == 0.0


def test_zero2_replaces_full_gradients_with_the_shard() -> None:
    cfg = _load(GLM9B)
    one = plan(cfg).ranks[0]
    two = plan(cfg, features=Features(shard_gradients=True)).ranks[0]
    main_grads = one.moments["backward: layer"]["main_grads"]
    assert main_grads > 30 * GIB and two.moments["backward: layer"]["main_grads"] == 0
    shard = two.moments["backward: layer"]["grad_shard"]
    assert shard == one.moments["backward: layer"]["master_weights"]  # float32 ÷ 8, like masters
    assert "optimizer step: reduce" not in two.moments  # reduced during backward
    assert two.moments["backward: layer"]["grad_buckets"] > 0
    assert two.total_bytes < one.total_bytes - 25 * GIB
    lora = _load(GLM9B_DPO)  # no shard_optimizer: nothing to shard into
    assert (
        plan(lora, features=Features(shard_gradients=True)).to_json()["ranks"]
        == plan(lora).to_json()["ranks"]
    )


def test_issue_target_by_the_plan() -> None:
    """GLM-4-9B at 4,194,304 tokens on one node of 8 H20s (96 GiB, 1.9 TB host) with every
    mechanism on: LoRA-DPO and the full fine-tune fit both budgets (and not without them).
    The full fine-tune fits because a tiled layer upcasts its bf16 input tile by tile: the
    plan of a layer holding its whole input upcast, one [S/cp, H] float32 tensor (8 GiB
    here), does not fit (the negative control)."""
    seq = 4194304
    common = [f"data.seq_len={seq}", f"model.max_seq_len={seq}", "train.grad_accum=1",
              "hardware.host_memory_gib=1769"]  # fmt: skip
    dpo = _load(GLM9B_DPO, *common, "parallel.pp=1", "parallel.cp=8")
    after = plan(dpo, features=AFTER)
    assert after.fits, format_plan(after, dpo)
    assert after.host is not None and after.host.budget_bytes == 1769 * GIB
    assert not plan(dpo).fits
    sft = _load(GLM9B, *common)
    full = plan(sft, features=AFTER)
    assert full.fits, format_plan(full, sft)
    assert not plan(sft).fits
    upcast = seq // 8 * sft.model.hidden_size * 4
    assert upcast == 8 * GIB
    assert full.peak.total_bytes + upcast > 96 * GIB
    assert np.isfinite(estimate(sft, features=AFTER).flops)


@pytest.mark.parametrize("lora", [False, True])
def test_checkpoint_model_part_is_the_models_numpy_bytes(lora: bool, tiny_cfg: TinyCfg) -> None:
    """The writer's model part is what `model_arrays` (or the adapters' arrays) copy out."""
    import paddle

    from flashcp.checkpoint.adapters import trainable_arrays
    from flashcp.checkpoint.state import model_arrays
    from flashcp.lora.model import apply_lora
    from flashcp.models import build_model
    from flashcp.plan.model import setup, stage_plan

    sections: dict[str, Any] = {"model": {"preset": "tiny_glm_moe"}}
    if lora:
        sections |= {"run": {"recipe": "dpo"}, "lora": {"rank": 4}}
    cfg = tiny_cfg(**sections)
    paddle.seed(0)
    model = build_model(cfg.model)
    if lora:
        apply_lora(model, rank=4, alpha=8.0, target_modules=list(cfg.extras["lora"].target_modules))
        arrays = trainable_arrays(model)
    else:
        arrays = model_arrays(model)
    _, _, host = stage_plan(setup(cfg), 0)
    assert host.model_part == sum(a.nbytes for a in arrays.values())


def test_features_come_from_their_config_keys() -> None:
    """`features_of` reads each mechanism's key: a config that sets them plans as the same
    config given the `Features` value."""
    from flashcp.plan.features import features_of

    keys = ["train.offload_activations=true", "model.residual_dtype=bfloat16",
            "model.tile_tokens=4096", "attention.query_chunk=16384",
            "attention.kv_chunk=65536", "parallel.shard_gradients=true"]  # fmt: skip
    cfg = _load(GLM9B, *keys)
    f = Features(offload_activations=True, residual_dtype="bfloat16", tile_tokens=4096,
                 query_chunk=16384, kv_chunk=65536, shard_gradients=True)  # fmt: skip
    assert features_of(cfg) == f and features_of(_load(GLM9B)) == Features()
    assert plan(cfg).to_json() == plan(_load(GLM9B), features=f).to_json()
