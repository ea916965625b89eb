"""Collectives without a second process (`flashcp.distributed.collectives`): the send/recv order
of a ring shift never deadlocks, one-rank groups stay local, argument checks, group labels."""

from __future__ import annotations

from collections import deque

import numpy as np
import paddle
import pytest
from paddle.distributed.communication.group import Group

from flashcp.distributed import (
    CommStats,
    NamedGroup,
    all_gather_tensor,
    all_reduce_tensor,
    barrier,
    broadcast_tensor,
    comm_stats,
    group_backend,
    group_label,
    reduce_scatter,
    reduce_scatter_chunks,
    reset_comm_stats,
    ring_shift,
    sends_first,
)

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
