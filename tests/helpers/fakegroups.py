"""Fakes of the process groups on CPU: `new_group` for the NCCL group-building path, one
rank's groups of an expert-parallel or a pipeline layout (no traffic), and groups whose
`paddle.distributed` calls return at once with a task (`MirrorNccl`), for the collectives'
watchdog path; `FakeDevice` counts device drains."""

from __future__ import annotations

import threading
from typing import Any

import paddle
import pytest
from paddle.distributed.communication.group import Group

from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups, collectives, p2p
from flashcp.distributed.watchdog import Watchdog


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


class FakeTask:
    """What `paddle.distributed` returns for an NCCL call: `is_completed()` answers whether
    the device ran it (here: once `release` is set)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.queries = 0

    def is_completed(self) -> bool:
        self.queries += 1
        return self.release.is_set()


class FakeDevice:
    """Counts device drains (`paddle.device.synchronize`, `paddle.device.cuda.synchronize`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.syncs = 0
        monkeypatch.setattr(paddle.device, "synchronize", self._sync)
        monkeypatch.setattr(paddle.device.cuda, "synchronize", self._sync)

    def _sync(self, device: Any = None) -> None:
        self.syncs += 1


class MirrorNccl:
    """`paddle.distributed` over NCCL groups whose other ranks mirror this one (they hold the
    same tensors): every call returns at once with a `FakeTask`, its result already in place."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, completes: bool = True) -> None:
        self.release = threading.Event()
        if completes:
            self.release.set()
        self.tasks: list[FakeTask] = []
        self.fired: list[str] = []
        self.dog = Watchdog(on_expire=self.fired.append, poll_seconds=0.01)
        monkeypatch.setattr(collectives, "WATCHDOG", self.dog)
        monkeypatch.setattr(p2p, "WATCHDOG", self.dog)
        dist = collectives.dist
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "send", "recv",
                     "alltoall_single", "all_gather_object", "barrier"):  # fmt: skip
            monkeypatch.setattr(dist, name, getattr(self, name))

    def _task(self) -> FakeTask:
        task = FakeTask(self.release)
        self.tasks.append(task)
        return task

    def all_reduce(self, x: Any, group: Any = None, **_: Any) -> FakeTask:
        paddle.assign(x * int(group.nranks), output=x)
        return self._task()

    def all_gather(self, parts: list[Any], x: Any, group: Any = None, **_: Any) -> FakeTask:
        parts.extend(x.clone() for _ in range(int(group.nranks)))
        return self._task()

    def broadcast(self, x: Any, src: int = 0, group: Any = None, **_: Any) -> FakeTask:
        return self._task()

    def reduce_scatter(self, out: Any, chunks: list[Any], group: Any = None, **_: Any) -> Any:
        paddle.assign(chunks[int(group.rank)] * int(group.nranks), output=out)
        return self._task()

    def send(self, x: Any, dst: int = 0, group: Any = None, **_: Any) -> FakeTask:
        return self._task()

    def recv(self, x: Any, src: int = 0, group: Any = None, **_: Any) -> FakeTask:
        return self._task()

    def alltoall_single(
        self, out: Any, x: Any, send: list[int], recv: list[int], group: Any = None
    ) -> FakeTask:
        """What a mirror sends this rank is this rank's own block for itself; a block of
        another size (rows a peer's experts processed) arrives as zeros of that size."""
        me, rest = int(group.rank), list(x.shape[1:])
        mine = paddle.split(x, send, axis=0)[me] if x.shape[0] else x
        parts = [mine if n == send[me] else paddle.zeros([n, *rest], dtype=x.dtype) for n in recv]
        paddle.assign(paddle.concat(parts, axis=0), output=out)
        return self._task()

    def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        out.extend(obj for _ in range(int(group.nranks)))  # Paddle reads it back: host-side

    def barrier(self, group: Any = None) -> None:  # Paddle's NCCL barrier blocks the host
        return None


def mirror_groups(dp: int = 2, ep: int = 1) -> ParallelGroups:
    """Rank 0's groups of a dp (× ep inside dp) job on NCCL: one process, the other ranks
    mirror it."""
    ranks = list(range(dp))

    def group(dim: str, members: list[int], gid: int) -> NamedGroup:
        return NamedGroup(dim, 0, gid, members, pg=FakeNewGroup.PG() if len(members) > 1 else None)

    world = group("world", ranks, 0)
    return ParallelGroups(
        dims=ParallelDims(dp=dp, pp=1, cp=1, world_size=dp, ep=ep), rank=0, world=world,
        dp=group("dp", ranks, 1), pp=group("pp", [0], 2), cp=group("cp", [0], 3),
        backend="nccl", ep=group("ep", ranks[:ep], 4), edp=group("edp", ranks[::ep], 5),
    )  # fmt: skip
