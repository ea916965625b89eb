"""Group building (`flashcp.distributed.groups`) without a job: waiting for a store's port, and the
NCCL group-building path against a fake `new_group` (every rank creates every group, in order)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from flashcp.distributed import ParallelDims, group_backend, wait_for_port
from flashcp.distributed.groups import _nccl_groups
from helpers.fakegroups import FakeNewGroup


def test_wait_for_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert wait_for_port("127.0.0.1", port, 5) < 5
    with pytest.raises(TimeoutError, match="rank 0's store at 127.0.0.1:.* within 0.2 s"):
        wait_for_port("127.0.0.1", port, 0.2, what="rank 0's store")


def test_wait_for_port_sees_late_listener() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        assert 0.2 < wait_for_port("127.0.0.1", port, 10) < 10
    finally:
        thread.join()
        server.close()


@pytest.mark.parametrize("rank", range(8))
def test_nccl_path_every_rank_creates_every_group_in_order(rank: int) -> None:
    dims = ParallelDims(dp=2, pp=2, cp=2, world_size=8)
    fake = FakeNewGroup()
    mine = _nccl_groups(dims, rank, 60, fake)
    assert fake.calls == dims.groups_for("dp") + dims.groups_for("pp") + dims.groups_for("cp")
    for dim in ("dp", "pp", "cp"):
        group = mine[dim]
        assert group.ranks == dims.group_ranks(dim, rank)
        assert group.rank == dims.rank_in(dim, rank)
        assert group_backend(group) == "nccl"
        assert group.label == f"{dim}[{','.join(map(str, group.ranks))}]"


def test_nccl_path_skips_world_spanning_and_trivial_dims() -> None:
    dims = ParallelDims(dp=1, pp=1, cp=4, world_size=4)
    fake = FakeNewGroup()
    assert _nccl_groups(dims, 1, 60, fake) == {}
    assert fake.calls == []
