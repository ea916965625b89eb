"""The watchdog (`flashcp.distributed.watchdog`): deadlines, the timeout and its message; a hung
NCCL collective times out at the collective (issue 13 point 6), tested on CPU.

NCCL calls return once the collective is enqueued; Paddle's `task.wait()` (what `sync_op=True`
runs) only orders the compute stream after the communication stream
(`ProcessGroupNCCL::NCCLTask::Wait` blocks the host only under FLAGS_nccl_blocking_wait). In
debug mode (`FLASHCP_SYNC_COLLECTIVES=1`, set here; the default tracks the tasks instead:
`test_collective_tracking.py`) the collectives wait for the device with
`paddle.device.synchronize()` inside the watched block. Here the NCCL side is faked:
`paddle.distributed.*` return at once (enqueued) and `paddle.device.synchronize` stands for a
GPU whose collective never completes, so the watchdog must fire, while armed, with the
standard message naming the op, group and peers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import paddle
import pytest

from flashcp.distributed import (
    NamedGroup,
    Watchdog,
    collectives,
    p2p,
    resolve_timeout,
    timeout_message,
)


class _PG:
    def __init__(self, backend: str) -> None:
        self.backend = backend

    def name(self) -> str:
        return self.backend


class _Group:
    """What the collectives read from a Paddle Group: rank, nranks, ranks, name, id, pg."""

    def __init__(self, backend: str, ranks: list[int] | None = None) -> None:
        self.ranks = ranks or [0, 1]
        self.rank, self.nranks = 0, len(self.ranks)
        self.name, self.id = "cp", 3
        self.process_group = _PG(backend)


class _FakeNccl:
    """`paddle.distributed` calls that only enqueue (return at once), and a device whose
    queued collective hangs until the watchdog gives up (then it is released)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fired: list[str] = []
        self.release = threading.Event()
        self.syncs: list[int] = []  # watchdog deadlines pending at each device sync
        self.dog = Watchdog(on_expire=self._expired)
        monkeypatch.setenv("FLASHCP_SYNC_COLLECTIVES", "1")
        monkeypatch.setattr(collectives, "WATCHDOG", self.dog)
        monkeypatch.setattr(p2p, "WATCHDOG", self.dog)
        dist = collectives.dist
        monkeypatch.setattr(dist, "all_gather", lambda parts, x, group: parts.extend([x, x]))
        for name in ("all_reduce", "barrier", "broadcast", "send", "recv", "reduce_scatter"):
            monkeypatch.setattr(dist, name, lambda *a, **k: None)
        monkeypatch.setattr(paddle.device, "synchronize", self._synchronize)

    def _expired(self, message: str) -> None:
        self.fired.append(message)
        self.release.set()  # the real default ends the process here (exit 124)

    def _synchronize(self, device: Any = None) -> None:
        self.syncs.append(self.dog.pending)
        assert self.release.wait(10), "the watchdog never fired"


OPS: dict[str, Callable[[Any], Any]] = {
    "barrier": lambda g: collectives.barrier(g, timeout=0.2),
    "all_gather": lambda g: collectives.all_gather_tensor(paddle.ones([2]), g, timeout=0.2),
    "all_reduce": lambda g: collectives.all_reduce_tensor(paddle.ones([2]), g, timeout=0.2),
    "broadcast": lambda g: collectives.broadcast_tensor(paddle.ones([2]), 1, g, timeout=0.2),
    "reduce_scatter[nccl]": lambda g: collectives.reduce_scatter_chunks(
        [paddle.ones([2]), paddle.ones([2])], g, timeout=0.2
    ),
    "ring_shift(shift=1)": lambda g: collectives.ring_shift(paddle.ones([2]), g, timeout=0.2),
    "send(to rank 1)": lambda g: p2p.send_tensor(paddle.ones([2]), 1, g, timeout=0.2),
    "recv(from rank 1)": lambda g: p2p.recv_tensor([2], "float32", 1, g, timeout=0.2),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_hung_nccl_collective_times_out_at_the_collective(monkeypatch, op: str) -> None:
    fake = _FakeNccl(monkeypatch)
    group = _Group("NCCL")
    OPS[op](group)
    assert fake.syncs == [1], "the device wait must run while the watchdog is armed"
    assert len(fake.fired) == 1
    message = fake.fired[0]
    assert f"{op} on group cp[0,1] timed out after 0.2 s on rank 0" in message
    assert "rank 1 may be" in message
    assert fake.dog.pending == 0


def test_message_names_every_peer(monkeypatch) -> None:
    fake = _FakeNccl(monkeypatch)
    collectives.barrier(_Group("NCCL", [0, 2, 5]), timeout=0.2)
    assert "one of ranks 2, 5 may be dead, hung or skipped this collective" in fake.fired[0]


def test_gloo_calls_do_not_wait_on_the_device(monkeypatch) -> None:
    """Gloo collectives are synchronous on the host already: no device synchronisation."""
    fake = _FakeNccl(monkeypatch)
    group = _Group("GLOO")
    collectives.barrier(group, timeout=5)
    collectives.all_gather_tensor(paddle.ones([2]), group, timeout=5)
    p2p.send_tensor(paddle.ones([2]), 1, group, timeout=5)
    assert fake.syncs == [] and fake.fired == []


def test_completed_nccl_collective_disarms(monkeypatch) -> None:
    fake = _FakeNccl(monkeypatch)
    fake.release.set()  # the GPU finishes the collective at once
    out = collectives.all_gather_tensor(paddle.ones([2]), _Group("NCCL"), timeout=5)
    assert out.shape == [4] and fake.syncs == [1] and fake.fired == []
    assert fake.dog.pending == 0


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
