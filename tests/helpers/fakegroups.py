"""Groups without processes: a fake `paddle.distributed.new_group` for the NCCL group-building
path on CPU, and one rank's groups of an expert-parallel or a pipeline layout (no traffic)."""

from __future__ import annotations

from paddle.distributed.communication.group import Group

from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups


class FakeNewGroup:
    """Records calls like every rank would make them; returns groups with a fake NCCL pg."""

    class PG:
        def name(self) -> str:
            return "NCCL"

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, ranks: list[int], backend: str, timeout: object) -> Group:
        assert backend == "nccl"
        self.calls.append(list(ranks))
        gid = 10 + len(self.calls)
        return Group(0, gid, list(ranks), pg=self.PG(), name=f"_default_pg{gid}")


def ep_groups(ep_rank: int = 0, ep: int = 1) -> ParallelGroups:
    """Rank `ep_rank`'s groups of a dp=1 cp=ep ep=ep layout, without any process group."""
    dims = ParallelDims(dp=1, pp=1, cp=ep, world_size=ep, ep=ep)
    cp = NamedGroup("cp", ep_rank, 5, list(range(ep)), pg=None)
    solo = NamedGroup("dp", 0, -1, [ep_rank], pg=None)
    epg = NamedGroup("ep", ep_rank, 6, list(range(ep)), pg=None)
    world = NamedGroup("world", ep_rank, 0, list(range(ep)), pg=None)
    return ParallelGroups(dims, ep_rank, world, solo, solo, cp, "none", ep=epg)


def pp_groups(pp: int, stage: int) -> ParallelGroups:
    """Stage `stage`'s groups of a dp=1 pp=`pp` cp=1 layout, without any process group (the pp
    group's backend is "none": used as is)."""
    ranks = list(range(pp))
    group = NamedGroup("pp", stage, 77, ranks, pg=None)  # backend "none": used as is
    solo = NamedGroup("cp", 0, -1, [stage], pg=None)
    dims = ParallelDims(dp=1, pp=pp, cp=1, world_size=pp)
    return ParallelGroups(dims, stage, group, solo, group, solo, "none")
