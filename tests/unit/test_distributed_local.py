"""Distributed layer pieces that need no second process: watchdog, counters, send/recv order,
one-rank groups, env parsing, and the NCCL group-building path against a fake `new_group`."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque

import numpy as np
import paddle
import pytest
from paddle.distributed.communication.group import Group

from flashcp.distributed import (
    CommStats,
    NamedGroup,
    ParallelDims,
    Watchdog,
    all_gather_tensor,
    all_reduce_tensor,
    barrier,
    broadcast_tensor,
    build_groups,
    comm_stats,
    group_backend,
    group_label,
    init_distributed,
    launch_env,
    master_endpoint,
    reduce_scatter,
    reduce_scatter_chunks,
    reset_comm_stats,
    resolve_timeout,
    ring_shift,
    sends_first,
    shutdown,
    timeout_message,
    wait_for_port,
)
from flashcp.distributed.counters import CommCounters
from flashcp.distributed.groups import _nccl_groups
from helpers.fakegroups import FakeNewGroup

# -- watchdog ---------------------------------------------------------------------------------


def test_watchdog_fires_with_message() -> None:
    fired: list[str] = []
    dog = Watchdog(on_expire=fired.append)
    with dog.watch(0.05, "all_gather on group cp[0,1] timed out"):
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
    assert fired == ["all_gather on group cp[0,1] timed out"]
    assert dog.pending == 0


def test_watchdog_disarmed_block_does_not_fire() -> None:
    fired: list[str] = []
    dog = Watchdog(on_expire=fired.append)
    with dog.watch(0.2, "slow"):
        pass
    token = dog.arm(10, "later")
    time.sleep(0.3)
    dog.disarm(token)
    assert fired == [] and dog.pending == 0


def test_watchdog_earliest_deadline_first() -> None:
    fired: list[str] = []
    dog = Watchdog(on_expire=fired.append)
    dog.arm(0.3, "second")
    dog.arm(0.05, "first")
    deadline = time.monotonic() + 5
    while len(fired) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired == ["first", "second"]


def test_resolve_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHCP_COLLECTIVE_TIMEOUT", raising=False)
    monkeypatch.delenv("FLASHCP_INIT_TIMEOUT", raising=False)
    assert resolve_timeout() == 300.0
    assert resolve_timeout(7) == 7.0
    monkeypatch.setenv("FLASHCP_COLLECTIVE_TIMEOUT", "12.5")
    monkeypatch.setenv("FLASHCP_INIT_TIMEOUT", "40")
    assert resolve_timeout() == 12.5
    assert resolve_timeout(init=True) == 40.0
    monkeypatch.setenv("FLASHCP_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FLASHCP_COLLECTIVE_TIMEOUT='soon' is not a number"):
        resolve_timeout()
    monkeypatch.setenv("FLASHCP_COLLECTIVE_TIMEOUT", "0")
    with pytest.raises(ValueError, match="must be > 0"):
        resolve_timeout()
    with pytest.raises(ValueError, match="positive number of seconds"):
        resolve_timeout(-1)


def test_timeout_message_names_group_op_and_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    group = NamedGroup("cp", 0, 7, [0, 1], pg=None)
    text = timeout_message("all_gather", group, 30)
    assert text.startswith("[flashcp] all_gather on group cp[0,1] timed out after 30 s on rank 0")
    assert "rank 1 may be dead" in text
    wide = NamedGroup("dp", 0, 8, [0, 2, 4], pg=None)
    assert "one of ranks 2, 4 may be dead" in timeout_message("barrier", wide, 1.5)


# -- ordered send/recv ------------------------------------------------------------------------


def _completes(p: int, shift: int) -> bool:
    """Simulate blocking rendezvous send/recv; True when every rank finishes both ops."""
    ops = {}
    for r in range(p):
        send, recv = ("send", (r + shift) % p), ("recv", (r - shift) % p)
        ops[r] = deque([send, recv] if sends_first(r, shift, p) else [recv, send])
    progress = True
    while progress:
        progress = False
        for r in range(p):
            if not ops[r] or ops[r][0][0] != "send":
                continue
            dst = ops[r][0][1]
            if ops[dst] and ops[dst][0] == ("recv", r):
                ops[r].popleft()
                ops[dst].popleft()
                progress = True
    return all(not q for q in ops.values())


@pytest.mark.parametrize("p", range(2, 9))
def test_sends_first_never_deadlocks(p: int) -> None:
    for shift in range(1, p):
        assert _completes(p, shift), (p, shift)
        assert _completes(p, -shift), (p, -shift)


def test_all_send_first_would_deadlock() -> None:
    """The simulator itself detects the gloo deadlock the ordering avoids."""
    p = 2
    ops = {r: deque([("send", 1 - r), ("recv", 1 - r)]) for r in range(p)}
    assert all(ops[r][0][0] == "send" for r in range(p))  # nobody can make progress


# -- one-rank groups and argument checks ------------------------------------------------------


@pytest.fixture
def solo() -> NamedGroup:
    return NamedGroup("cp", 0, -1, [0], pg=None)


def test_one_rank_group_collectives_are_local(solo: NamedGroup) -> None:
    reset_comm_stats()
    x = paddle.to_tensor(np.arange(6, dtype="float32").reshape(2, 3))
    assert solo.is_trivial and solo.label == "cp[0]" and group_backend(solo) == "none"
    assert all_gather_tensor(x, solo, axis=1) is x
    np.testing.assert_array_equal(all_reduce_tensor(x, solo).numpy(), x.numpy())
    assert broadcast_tensor(x, 0, solo) is x
    np.testing.assert_array_equal(ring_shift(x, solo).numpy(), x.numpy())
    np.testing.assert_array_equal(reduce_scatter_chunks([x], solo).numpy(), x.numpy())
    np.testing.assert_array_equal(reduce_scatter(x, solo).numpy(), x.numpy())
    barrier(solo)
    assert comm_stats() == CommStats()


def test_argument_errors(solo: NamedGroup) -> None:
    x = paddle.ones([2])
    with pytest.raises(TypeError, match="needs an explicit group"):
        all_gather_tensor(x, None)  # type: ignore[arg-type]
    outsider = NamedGroup("cp", -1, 3, [2, 3], pg=None)
    with pytest.raises(ValueError, match="is not a member of group cp\\[2,3\\]"):
        all_reduce_tensor(x, outsider)
    with pytest.raises(ValueError, match="got 2 chunks for group cp\\[0\\] of 1 ranks"):
        reduce_scatter_chunks([x, x], solo)
    pair = NamedGroup("cp", 0, 4, [0, 1], pg=None)
    with pytest.raises(ValueError, match="chunk 1 has shape \\[3\\]"):
        reduce_scatter_chunks([x, paddle.ones([3])], pair)
    with pytest.raises(ValueError, match="not divisible by the 2 ranks"):
        reduce_scatter(paddle.ones([3]), pair)
    with pytest.raises(ValueError, match="method 'fast' is unknown"):
        reduce_scatter_chunks([x, x], pair, method="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'nccl' needs an NCCL group"):
        reduce_scatter_chunks([x, x], pair, method="nccl")
    with pytest.raises(ValueError, match="source rank 5 is not in group"):
        broadcast_tensor(x, 5, pair)


def test_group_label_for_plain_paddle_group() -> None:
    assert group_label(Group(0, 11, [0, 2], name="_default_pg11")) == "_default_pg11[0,2]"


# -- counters ---------------------------------------------------------------------------------


def test_counters_filter_and_reset() -> None:
    counters = CommCounters()
    counters.record("all_gather", "cp[0,1]", sent=10, received=12)
    counters.record("all_gather", "cp[0,1]", sent=10, received=12)
    counters.record("all_reduce", "dp[0,2]", sent=4, received=4)
    assert counters.total("all_gather") == CommStats(2, 20, 24)
    assert counters.total(group="dp[0,2]") == CommStats(1, 4, 4)
    assert counters.total() == CommStats(3, 24, 28)
    assert set(counters.snapshot()) == {("all_gather", "cp[0,1]"), ("all_reduce", "dp[0,2]")}
    counters.reset()
    assert counters.total() == CommStats()


# -- environment and single-process bootstrap ------------------------------------------------


def test_master_endpoint_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT", "PADDLE_MASTER", "PADDLE_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(key, raising=False)
    assert master_endpoint() is None
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6000,10.0.0.2:6000")
    assert master_endpoint() == "10.0.0.1:6000"
    monkeypatch.setenv("PADDLE_MASTER", "127.0.0.1:5000")
    assert master_endpoint() == "127.0.0.1:5000"
    monkeypatch.setenv("MASTER_ADDR", "host")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert master_endpoint() == "host:1234"


def test_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "2")
    env = launch_env()
    assert (env.rank, env.world_size, env.is_distributed) == (2, 4, True)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "4")
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        launch_env()
    monkeypatch.setenv("PADDLE_TRAINER_ID", "x")
    with pytest.raises(ValueError, match="PADDLE_TRAINER_ID='x' is not an integer"):
        launch_env()


def test_single_process_bootstrap_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.initialized) == (0, 1, False)
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
    assert [groups[d].label for d in ("world", "dp", "pp", "cp")] == [
        "world[0]",
        "dp[0]",
        "pp[0]",
        "cp[0]",
    ]
    assert groups.backend == "none" and all(groups[d].is_trivial for d in ("dp", "pp", "cp"))
    with pytest.raises(KeyError):
        groups["tp"]
    with pytest.raises(
        ValueError, match=r"ParallelDims is for 2 ranks .*init_distributed\(\) first"
    ):
        build_groups(ParallelDims(dp=1, pp=1, cp=2, world_size=2))
    shutdown()


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


# -- NCCL path with a fake new_group ----------------------------------------------------------


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
