"""flashcp's byte counters (`flashcp.distributed.counters`) equal the bytes handed to the transport,
call by call; filtering and reset.

`paddle.distributed.send` / `recv` / `all_gather` are replaced by in-process fakes (a rank of a
4-rank group whose peers are simulated), and the benchmark worker's `TransportTap`
(`bench.cp_worker`) wraps them, summing the nbytes of the tensors each call was handed (send),
filled (recv) or returned (all_gather). The counters must equal the tap exactly, and must
follow the tensors that actually moved, not a formula of the input: when the peers' all-gather
parts differ in size from this rank's input, the received count follows the parts. The real
multi-process version of this check is `tests/integration/test_bench_cp_smoke.py` (cp 2 and 4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

from bench.cp_worker import TransportTap
from flashcp.distributed import (
    CommStats,
    NamedGroup,
    all_gather_tensor,
    all_reduce_tensor,
    comm_stats,
    reduce_scatter_chunks,
    reset_comm_stats,
    ring_shift,
)
from flashcp.distributed.collectives import nbytes
from flashcp.distributed.counters import CommCounters
from flashcp.distributed.p2p import recv_tensor, send_tensor
from flashcp.distributed.watchdog import WATCHDOG

ME, RANKS = 1, [0, 1, 2, 3]


class FakeTransport:
    """Peers simulated in-process: all_gather returns `peer_scale`-times-longer peer parts."""

    def __init__(self, peer_scale: int = 1) -> None:
        self.peer_scale = peer_scale
        self.log: list[tuple[str, int]] = []

    def all_gather(self, tensor_list: list[Any], tensor: Any, group: Any = None, **_: Any) -> None:
        for i in range(group.nranks):
            if i == group.rank:
                tensor_list.append(tensor.clone())
            else:
                tensor_list.append(paddle.concat([tensor] * self.peer_scale, axis=0) + i)
        self.log.append(("all_gather", nbytes(tensor)))

    def send(self, tensor: Any, dst: int = 0, group: Any = None, **_: Any) -> None:
        assert dst in group.ranks and dst != ME
        self.log.append(("send", nbytes(tensor)))

    def recv(self, tensor: Any, src: int = 0, group: Any = None, **_: Any) -> None:
        assert src in group.ranks and src != ME
        paddle.assign(paddle.full_like(tensor, float(src)), output=tensor)
        self.log.append(("recv", nbytes(tensor)))

    def all_reduce(self, tensor: Any, group: Any = None, **_: Any) -> None:
        self.log.append(("all_reduce", nbytes(tensor)))


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> NamedGroup:
    monkeypatch.setenv("PADDLE_TRAINER_ID", str(ME))
    return NamedGroup("cp", RANKS.index(ME), 7, RANKS, pg=None)


def _install(monkeypatch: pytest.MonkeyPatch, fake: FakeTransport) -> None:
    for name in ("all_gather", "send", "recv", "all_reduce"):
        monkeypatch.setattr(dist, name, getattr(fake, name))


def _counted(group: NamedGroup) -> tuple[int, int]:
    stats = comm_stats(group=group.label)
    return stats.sent, stats.received


def test_counters_equal_the_tensors_handed_to_the_transport(
    monkeypatch: pytest.MonkeyPatch, group: NamedGroup
) -> None:
    fake = FakeTransport()
    _install(monkeypatch, fake)
    x32 = paddle.ones([2, 3, 5], dtype="float32")
    x64 = paddle.ones([4, 3], dtype="float64")
    chunks = [paddle.full([6, 5], float(i), dtype="float32") for i in range(len(RANKS))]
    reset_comm_stats()
    with TransportTap() as tap:
        gathered = all_gather_tensor(x32, group, axis=0)
        all_gather_tensor(x64, group, axis=1)
        reduced = reduce_scatter_chunks(chunks, group, method="ring")
        ring_shift(x32, group, shift=2)
        send_tensor(x64, 3, group)
        recv_tensor([7], "float32", 0, group)
    assert list(gathered.shape) == [8, 3, 5] and list(reduced.shape) == [6, 5]
    assert tap.other_calls == 0
    assert _counted(group) == (tap.sent, tap.received)
    # and the tap saw exactly the fakes' traffic: 3 peers per all-gather, p - 1 = 3 ring steps
    p = len(RANKS)
    want_sent = (p - 1) * (120 + 96) + (p - 1) * 120 + 120 + 96
    want_received = (p - 1) * (120 + 96) + (p - 1) * 120 + 120 + 28
    assert (tap.sent, tap.received) == (want_sent, want_received)
    assert [op for op, _ in fake.log].count("send") == (p - 1) + 1 + 1
    assert comm_stats("reduce_scatter", group.label).calls == 1  # one record per call


def test_all_gather_counts_the_parts_it_returned_not_a_formula(
    monkeypatch: pytest.MonkeyPatch, group: NamedGroup
) -> None:
    """Peers' parts twice this rank's size: received follows the parts (negative control for
    a counter that would compute (p - 1) · nbytes(input))."""
    _install(monkeypatch, FakeTransport(peer_scale=2))
    x = paddle.ones([2, 4], dtype="float32")
    reset_comm_stats()
    with TransportTap() as tap:
        out = all_gather_tensor(x, group, axis=0)
    assert list(out.shape) == [2 + 3 * 4, 4]
    sent, received = _counted(group)
    assert (sent, received) == (tap.sent, tap.received) == (3 * 32, 3 * 64)
    assert received != (len(RANKS) - 1) * nbytes(x)


def test_tap_flags_collectives_it_does_not_measure(
    monkeypatch: pytest.MonkeyPatch, group: NamedGroup
) -> None:
    _install(monkeypatch, FakeTransport())
    with TransportTap() as tap:
        all_reduce_tensor(paddle.to_tensor(np.ones(4, dtype=np.float32)), group)
    assert tap.other_calls == 1 and tap.sent == tap.received == 0
    # on exit the tap puts back what it wrapped (here the fake)
    assert isinstance(getattr(dist.all_reduce, "__self__", None), FakeTransport)


class _NcclPG:
    """Enough of a process group for `group_backend` to report NCCL."""

    def name(self) -> str:
        return "NCCL"


def test_library_reduce_scatters_count_their_documented_model(
    monkeypatch: pytest.MonkeyPatch, group: NamedGroup
) -> None:
    """The "nccl" and "allreduce" variants hand the whole transfer to the library, which does
    not report its traffic: they count (p - 1)/p resp. 2 (p - 1)/p of the tensors handed."""
    fake = FakeTransport()
    _install(monkeypatch, fake)

    class Task:  # a completed NCCL task (`paddle.base.core.task`)
        def is_completed(self) -> bool:
            return True

    def reduce_scatter(out: Any, chunks: list[Any], group: Any = None, **_: Any) -> Task:
        paddle.assign(paddle.add_n(chunks), output=out)
        return Task()

    monkeypatch.setattr(dist, "reduce_scatter", reduce_scatter)
    synced: list[int] = []  # the NCCL path never drains the device: it hands its task over
    monkeypatch.setattr(paddle.device, "synchronize", lambda *a, **k: synced.append(1))
    tracked = WATCHDOG.tracked
    nccl = NamedGroup("cp", RANKS.index(ME), 8, RANKS, pg=_NcclPG())
    chunks = [paddle.full([5], float(i), dtype="float32") for i in range(len(RANKS))]
    total = sum(nbytes(c) for c in chunks)
    p = len(RANKS)
    with TransportTap() as tap:
        reset_comm_stats()
        reduce_scatter_chunks(chunks, nccl, method="nccl")
        assert _counted(nccl) == ((p - 1) * total // p,) * 2
        reset_comm_stats()
        reduce_scatter_chunks(chunks, group, method="allreduce")
        assert _counted(group) == (2 * (p - 1) * total // p,) * 2
    assert tap.other_calls == 2 and tap.sent == tap.received == 0  # flagged as untapped
    assert not synced, "the NCCL reduce-scatter drained the device"
    assert WATCHDOG.tracked == tracked + 1, "its task did not go to the watchdog"


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
