"""`FLASHCP_CHECK_COLLECTIVES` (`flashcp.distributed.check`): off by default and free then;
on, a call's fingerprint (operation, shapes, call index per group, call site) is what the ranks
compare. The two-rank exchange itself runs in
`tests/integration/test_groups_multiproc.py::test_two_processes_cp2_collectives_exact`."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import paddle
import pytest

from flashcp.distributed import check

GROUP = SimpleNamespace(nranks=2)


class Exchange:
    """What the faked `all_gather_object` saw (`seen`) and rank 1's fingerprint (`peer`; None:
    a copy of this rank's)."""

    def __init__(self) -> None:
        self.seen: list[check.Fingerprint] = []
        self.peer: check.Fingerprint | None = None

    def __call__(self, out: list[Any], obj: check.Fingerprint, group: Any) -> None:
        self.seen.append(obj)
        other = self.peer or check.Fingerprint(1, obj.op, obj.shapes, obj.index, "x.py:1", obj.op)
        out.extend([obj, other])


@pytest.fixture
def exchange(monkeypatch: pytest.MonkeyPatch) -> Iterator[Exchange]:
    """Check mode on, over a faked two-rank exchange."""
    monkeypatch.setenv(check.ENV_CHECK, "1")
    check.reset()
    fake = Exchange()
    monkeypatch.setattr(check.dist, "all_gather_object", fake)
    yield fake
    check.reset()


def test_off_by_default_and_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: Any, **_k: Any) -> None:
        raise AssertionError("no exchange expected")

    monkeypatch.setattr(check.dist, "all_gather_object", boom)
    monkeypatch.delenv(check.ENV_CHECK, raising=False)
    assert not check.enabled()
    check.agree("all_reduce", GROUP, "cp[0,1]", [paddle.ones([3])])
    monkeypatch.setenv(check.ENV_CHECK, "1")
    check.agree("all_reduce", SimpleNamespace(nranks=1), "cp[0]", [paddle.ones([3])])


def test_matching_calls_pass_and_count_per_group(exchange: Exchange) -> None:
    check.agree("all_reduce", GROUP, "cp[0,1]", [paddle.ones([3], "float64")])
    check.agree("all_gather(axis=1)", GROUP, "cp[0,1]", [paddle.ones([1, 4])])
    check.agree("barrier", GROUP, "dp[0,2]")
    assert [(f.op, f.shapes, f.index) for f in exchange.seen] == [
        ("all_reduce", ("float64[3]",), 1),
        ("all_gather(axis=1)", ("float32[1,4]",), 2),
        ("barrier", (), 1),
    ]
    # the call site is the caller's, outside flashcp.distributed
    assert exchange.seen[0].site.startswith("test_check.py:")


def test_a_diverging_rank_is_named_with_its_call(exchange: Exchange) -> None:
    exchange.peer = check.Fingerprint(
        1, "reduce_scatter", ("float32[2,8]",), 1, "allgather_kv.py:9 backward", "reduce_scatter"
    )
    with pytest.raises(check.CollectiveMismatchError) as info:
        check.agree("all_reduce", GROUP, "cp[0,1]", [paddle.ones([3], "float64")])
    text = str(info.value)
    assert text.startswith("collective mismatch on cp[0,1] at call #1: rank 0 all_reduce "
                           "float64[3] at test_check.py:")  # fmt: skip
    assert text.endswith("| rank 1 reduce_scatter float32[2,8] at allgather_kv.py:9 backward")
    # a rank that skipped a call: same operation, another call index
    exchange.peer = check.Fingerprint(1, "all_reduce", ("float64[3]",), 7, "t.py:1", "all_reduce")
    with pytest.raises(check.CollectiveMismatchError, match=r"at call #2: .* \(call #7\)$"):
        check.agree("all_reduce", GROUP, "cp[0,1]", [paddle.ones([3], "float64")])


@pytest.mark.parametrize(
    ("mine", "peers"),
    [
        (paddle.ones([3], "float64"), ("float64[4]",)),  # another length
        (paddle.ones([2, 8]), ("float32[8,2]",)),  # the same size, transposed
        (paddle.ones([3], "float64"), ("float32[3]",)),  # another dtype
        (paddle.ones([3], "float64"), ("float64[3]", "float64[3]")),  # another tensor count
    ],
    ids=["shape", "transposed", "dtype", "count"],
)
def test_same_operation_with_other_shapes_or_dtypes_is_a_mismatch(
    exchange: Exchange, mine: paddle.Tensor, peers: tuple[str, ...]
) -> None:
    """Ranks in the same collective at the same call index, handing it tensors of another
    shape or dtype, raise naming both (gloo would sum mismatched buffers or hang)."""
    exchange.peer = check.Fingerprint(1, "all_reduce", peers, 1, "t.py:1 f", "all_reduce")
    with pytest.raises(check.CollectiveMismatchError) as info:
        check.agree("all_reduce", GROUP, "cp[0,1]", [mine])
    text = str(info.value)
    assert f"rank 0 all_reduce {check.tensor_text(mine)} at test_check.py:" in text
    assert text.endswith(f"| rank 1 all_reduce {' '.join(peers)} at t.py:1 f")
    # the negative control: the peer's fingerprint with this rank's tensors passes
    exchange.peer = None
    check.agree("all_reduce", GROUP, "cp[0,1]", [mine])
