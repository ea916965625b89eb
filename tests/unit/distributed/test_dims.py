"""ParallelDims: validation messages, rank layout (cp innermost), group rank lists."""

from __future__ import annotations

import itertools

import pytest

from flashcp.distributed.dims import DIM_ORDER, ParallelDims


def test_mismatch_message_shows_factors_keys_and_fixes() -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims(dp=1, pp=2, cp=2, world_size=2)
    message = str(info.value)
    assert "dp(1) × pp(2) × cp(2) = 4 but the job has 2 processes" in message
    assert "set parallel.cp to 1" in message
    assert "set parallel.pp to 1" in message
    assert "parallel.dp" not in message  # dp alone cannot fix it (pp*cp = 4 > 2)
    assert "--nproc_per_node 4" in message


def test_mismatch_without_single_key_fix_names_every_key() -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims(dp=2, pp=2, cp=2, world_size=3)
    message = str(info.value)
    assert "dp(2) × pp(2) × cp(2) = 8 but the job has 3 processes" in message
    assert "parallel.dp, parallel.pp, parallel.cp" in message
    assert "--nproc_per_node 8" in message


def test_single_process_wording() -> None:
    with pytest.raises(ValueError, match=r"= 2 but the job has 1 process: set parallel.cp to 1"):
        ParallelDims(dp=1, pp=1, cp=2, world_size=1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
@pytest.mark.parametrize("dim", DIM_ORDER)
def test_degrees_must_be_positive_ints(dim: str, bad: object) -> None:
    kwargs: dict[str, object] = {"dp": 1, "pp": 1, "cp": 1, "world_size": 1}
    kwargs[dim] = bad
    with pytest.raises(ValueError, match=rf"{dim} must be an integer >= 1.*parallel\.{dim}"):
        ParallelDims(**kwargs)  # type: ignore[arg-type]


def test_world_size_must_be_positive_int() -> None:
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        ParallelDims(dp=1, pp=1, cp=1, world_size=0)


def test_layout_cp_innermost_dp_outermost() -> None:
    dims = ParallelDims(dp=2, pp=2, cp=2, world_size=8)
    assert [dims.coords(r) for r in range(4)] == [
        {"dp": 0, "pp": 0, "cp": 0},
        {"dp": 0, "pp": 0, "cp": 1},
        {"dp": 0, "pp": 1, "cp": 0},
        {"dp": 0, "pp": 1, "cp": 1},
    ]
    assert dims.coords(7) == {"dp": 1, "pp": 1, "cp": 1}
    assert dims.rank_at(dp=1, pp=0, cp=1) == 5


@pytest.mark.parametrize(
    ("dp", "pp", "cp", "expected"),
    [
        (1, 2, 2, {"cp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]]}),
        (2, 1, 2, {"cp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]]}),
        (2, 2, 1, {"cp": [[0], [1], [2], [3]], "pp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}),
        (1, 1, 4, {"cp": [[0, 1, 2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0], [1], [2], [3]]}),
        (
            2, 2, 2,
            {
                "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            },
        ),
        (1, 2, 3, {"cp": [[0, 1, 2], [3, 4, 5]], "pp": [[0, 3], [1, 4], [2, 5]], "dp": [[r] for r in range(6)]}),  # noqa: E501
    ],
)  # fmt: skip
def test_group_rank_lists(dp: int, pp: int, cp: int, expected: dict[str, list[list[int]]]) -> None:
    dims = ParallelDims(dp=dp, pp=pp, cp=cp, world_size=dp * pp * cp)
    for dim, groups in expected.items():
        assert dims.groups_for(dim) == groups
    assert dims.groups_for("world") == [list(range(dp * pp * cp))]


@pytest.mark.parametrize("degrees", list(itertools.product([1, 2, 3], repeat=3)))
def test_layout_invariants(degrees: tuple[int, int, int]) -> None:
    dp, pp, cp = degrees
    world = dp * pp * cp
    dims = ParallelDims(dp=dp, pp=pp, cp=cp, world_size=world)
    for dim in DIM_ORDER:
        groups = dims.groups_for(dim)
        assert len(groups) == world // dims.degree(dim)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        for group in groups:
            assert group == sorted(group) and len(group) == dims.size(dim)
            for index, rank in enumerate(group):
                assert dims.rank_in(dim, rank) == index
                assert dims.group_ranks(dim, rank) == group
                # members differ only in this dimension's coordinate
                others = {k: v for k, v in dims.coords(rank).items() if k != dim}
                assert others == {k: v for k, v in dims.coords(group[0]).items() if k != dim}
    for rank in range(world):
        assert dims.rank_at(**dims.coords(rank)) == rank


def test_sizes_enabled_and_describe() -> None:
    dims = ParallelDims(dp=1, pp=2, cp=2, world_size=4)
    assert dims.degrees == {"dp": 1, "pp": 2, "cp": 2}
    assert dims.size("cp") == dims.degree("cp") == 2
    assert dims.degree("world") == 4
    assert dims.enabled_dims == ("pp", "cp")
    assert not dims.enabled("dp")
    assert dims.rank_in("world", 3) == 3
    assert dims.describe() == "dp=1 pp=2 cp=2 (world 4, cp innermost)"


def test_bad_lookups() -> None:
    dims = ParallelDims(dp=1, pp=2, cp=2, world_size=4)
    with pytest.raises(KeyError, match="unknown parallel dimension 'tp'"):
        dims.groups_for("tp")
    with pytest.raises(ValueError, match=r"rank 4 is outside the job's ranks 0..3"):
        dims.coords(4)
    with pytest.raises(ValueError, match=r"cp index 2 is outside 0..1"):
        dims.rank_at(cp=2)
    with pytest.raises(ValueError, match="pp index must be an int"):
        dims.rank_at(pp=True)


def test_frozen() -> None:
    dims = ParallelDims(dp=1, pp=1, cp=1, world_size=1)
    with pytest.raises(AttributeError):
        dims.cp = 2  # type: ignore[misc]


@pytest.mark.parametrize("degrees", [(2, 2, 2), (1, 2, 2), (3, 1, 2), (2, 3, 1), (1, 1, 1)])
def test_optimizer_shards_are_the_stage_dp_cp_ranks_cp_major(degrees: tuple[int, int, int]) -> None:
    dp, pp, cp = degrees
    dims = ParallelDims(dp=dp, pp=pp, cp=cp, world_size=dp * pp * cp)
    assert dims.optimizer_shards == dp * cp
    for rank in range(dims.world_size):
        ranks = dims.optimizer_shard_ranks(rank)
        c = dims.coords(rank)
        # the same stage, every (dp, cp) pair once, listed by shard index cp·dp + dp
        assert sorted(ranks) == sorted(r for r in range(dims.world_size)
                                       if dims.coords(r)["pp"] == c["pp"])  # fmt: skip
        assert ranks[dims.optimizer_shard_index(rank)] == rank
        assert dims.optimizer_shard_index(rank) == c["cp"] * dp + c["dp"]
    # dp=2, pp=1, cp=2: ranks (dp,cp) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1); cp-major shard order
    four = ParallelDims(dp=2, pp=1, cp=2, world_size=4)
    assert four.optimizer_shard_ranks(3) == [0, 2, 1, 3]
