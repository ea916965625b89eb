"""A fake `paddle.distributed.new_group` for the NCCL group-building path on CPU."""

from __future__ import annotations

from paddle.distributed.communication.group import Group


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
