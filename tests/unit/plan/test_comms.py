"""The plan counts NCCL communicators (issue 21 item 8): one per process group a rank belongs
to, one per p2p pair it talks over, `NCCL_COMMUNICATOR_BYTES` each, beside the 1 GiB of
`GPU_FIXED_BYTES` (so one communicator plans the 2 GiB the fixed overhead was before).

The group count is checked against what `build_groups` creates on NCCL (the fake `new_group`
of `tests/fakegroups.py`), rank by rank; the pairs against the pipeline's neighbours and the
ranks that gather experts for a checkpoint (`ExpertArrays.collector`: edp rank 0)."""

from __future__ import annotations

import pytest

from flashcp.config import load_config
from flashcp.distributed.groups import _nccl_groups
from flashcp.plan import GIB, plan
from flashcp.plan.comms import NCCL_COMMUNICATOR_BYTES, communicators, job_dims
from flashcp.plan.model import GPU_FIXED_BYTES
from flashcp.plan.report import format_plan
from helpers.fakegroups import FakeNewGroup
from helpers.paths import ROOT

GLM = ROOT / "configs/glm"
LAYOUTS = {
    "cp8": (GLM / "glm4_9b_cp8.yaml", []),
    "pp2_cp4": (GLM / "glm4_9b_dpo_lora_pp2_cp4.yaml", []),
    "pp16_cp8": (GLM / "glm45_air_cp8.yaml", []),
    "pp2_cp4_ep4": (GLM / "glm45_air_dpo_lora_ep.yaml", []),
    "pp4_cp8_ep8": (GLM / "glm45_air_sft_ep8_pp4_cp8.yaml", []),
    "dp2_pp2_cp2_ep2": (GLM / "tiny_moe_ep2_cp2.yaml",
                        ["parallel.dp=2", "parallel.pp=2", "data.micro_batch_size=1",
                         "train.grad_accum=2"]),
    "pp3_tied": (GLM / "tiny_cp2.yaml", ["parallel.pp=3", "parallel.cp=1",
                                         "model.tie_embeddings=true", "model.num_layers=3",
                                         "train.grad_accum=3"]),
}  # fmt: skip


def _cfg(name: str):  # type: ignore[no-untyped-def]
    path, overrides = LAYOUTS[name]
    return load_config(path, overrides, allow_placeholders=True)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_groups_are_the_ones_build_groups_creates_on_nccl(name: str) -> None:
    cfg = _cfg(name)
    dims = job_dims(cfg)
    for rank in range(dims.world_size):
        made = _nccl_groups(dims, rank, 60, FakeNewGroup())  # this rank's non-world groups
        comms = communicators(cfg, rank)
        assert comms.groups == ("world", *made), (rank, comms.groups, sorted(made))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pairs_are_the_pipeline_neighbours_tied_ends_and_expert_gathers(name: str) -> None:
    cfg = _cfg(name)
    dims = job_dims(cfg)
    for rank in range(dims.world_size):
        pairs = communicators(cfg, rank).pairs
        stages = dims.group_ranks("pp", rank)
        s = stages.index(rank)
        neighbours = [stages[i] for i in (s - 1, s + 1) if 0 <= i < len(stages)]
        assert [p for w, p in pairs if w == "pp"] == neighbours
        tied = [p for w, p in pairs if w == "tied"]
        ends = cfg.model.tie_embeddings and dims.pp > 2 and s in (0, dims.pp - 1)
        assert tied == ([stages[-1] if s == 0 else stages[0]] if ends else [])
        gather = [p for w, p in pairs if w == "ep gather"]
        collector = dims.ep > 1 and dims.edp_group_ranks(rank).index(rank) == 0
        if not collector:
            assert gather == []
        elif dims.ep_rank(rank) == 0:  # the stage writer receives from its ep group
            assert gather == dims.ep_group_ranks(rank)[1:]
        else:
            assert gather == [dims.ep_group_ranks(rank)[0]]


def test_counts_of_the_shipped_layouts() -> None:
    assert communicators(_cfg("cp8"), 3).count == 1  # the cp group IS the world
    air = _cfg("pp16_cp8")  # world, pp, cp, and two neighbours in the middle of the pipeline
    assert [communicators(air, r).count for r in (0, 8, 127)] == [4, 5, 4]
    sft = _cfg("pp4_cp8_ep8")
    assert communicators(sft, 8).describe() == (
        "13 NCCL communicators (groups world, pp, cp, ep; p2p pp 2, ep gather 7)"
    )
    assert communicators(sft, 9).count == 4 + 2 + 1
    single = load_config(GLM / "tiny_cp2.yaml", ["parallel.cp=1"])
    assert communicators(single, 0).count == 0  # one process: no NCCL


def test_the_plan_carries_them_on_gpu_only() -> None:
    cfg = _cfg("pp4_cp8_ep8")
    gpu = plan(cfg, device="gpu")
    for r in gpu.ranks:
        assert r.items["nccl_communicators"] == communicators(cfg, r.rank).bytes
        assert all(m["nccl_communicators"] == r.items["nccl_communicators"]
                   for m in r.moments.values())  # fmt: skip
    # the stage's table shows its largest rank: the one gathering the experts
    assert [r.rank for r in gpu.stages()] == [0, 8, 16, 24]
    assert gpu.peak.communicators is not None and gpu.peak.communicators.count == 13
    text = format_plan(gpu, cfg)
    assert "(rank 8: 13 NCCL communicators (groups world, pp, cp, ep; p2p pp 2, ep gather 7), "\
        "1.00 GiB each)" in text
    cpu = plan(cfg, device="cpu")
    assert {r.items["nccl_communicators"] for r in cpu.ranks} == {0}
    # negative control: without counting, two ranks of a stage would plan the same
    assert gpu.ranks[8].total_bytes - gpu.ranks[9].total_bytes == 6 * NCCL_COMMUNICATOR_BYTES


def test_one_communicator_plans_what_the_fixed_overhead_did() -> None:
    """GLM-4-9B at cp 8: one communicator (the world), so its plan keeps the 2 GiB it had."""
    items = plan(_cfg("cp8"), device="gpu").peak.items
    assert items["nccl_communicators"] == NCCL_COMMUNICATOR_BYTES == GIB
    assert GPU_FIXED_BYTES + NCCL_COMMUNICATOR_BYTES == 2 * GIB
