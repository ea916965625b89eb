"""Mask rebasing for a CP rank's local query rows, checked against the dense oracle."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.cp.balance import balanced_assignment
from flashcp.cp.layout import Assignment
from flashcp.cp.rebase import local_positions, rebase_mask, rebase_thresholds
from flashcp.mask_families import FAMILIES
from flashcp.mask_indices import to_dense
from helpers.maskcases import overshoot

SEQ_LEN = 96  # divisible by 2·cp for every cp in CPS
CPS = (1, 2, 4, 8)


def dualchunk_reference(g: np.ndarray, rank: int, world: int, c: int) -> np.ndarray:
    """PaddleFleet's `preprocess_index_dual_chunks` (reference §2.2), written independently."""
    t1 = np.clip(g - rank * c, 0, c)
    t2 = np.clip(g - (2 * world - 1 - rank) * c, 0, c)
    t2 = np.where(t2 != 0, t2 + c, 0)  # shift into the second half; 0 stays 0
    return np.maximum(t1, t2)


def assert_rebase_matches(idx: np.ndarray, causal: bool, a: Assignment, rank: int) -> None:
    s = idx.shape[2]
    pos = a.positions(s, rank)
    local = rebase_mask(idx, causal=causal, assignment_or_positions=a, rank=rank)
    assert local.dtype == np.int32
    assert local.shape[:3] == idx.shape[:3] and local.shape[3] in (2, 4)
    got = to_dense(local, causal=False, q_len=pos.size)
    np.testing.assert_array_equal(got, to_dense(idx, causal=causal)[:, :, pos, :])


def layouts(world: int, idx: np.ndarray, causal: bool) -> dict[str, Assignment]:
    return {
        "dualchunk": Assignment.dualchunk(world),
        "contiguous": Assignment.contiguous(world),
        "balanced": balanced_assignment(
            idx, causal=causal, world=world, chunks_per_rank=SEQ_LEN // world // 4, block=8
        ),
    }


# --------------------------------------------------------------------------------------------
# The key test: every family, every cp, every rank, three layouts.


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("world", CPS)
def test_rebased_rows_equal_global_rows(family: str, world: int) -> None:
    for seed in (0, 1):
        mask = FAMILIES[family](2, SEQ_LEN, 2, seed)
        for a in layouts(world, mask.indices, mask.causal).values():
            for rank in range(world):
                assert_rebase_matches(mask.indices, mask.causal, a, rank)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("world", [2, 4])
def test_values_beyond_global_seq_mean_through_the_last_local_row(family: str, world: int) -> None:
    """Upstream's "any value >= S" form rebases to exactly the same local mask: every such
    threshold counts all L local rows, i.e. "through the last local row"."""
    mask = FAMILIES[family](2, SEQ_LEN, 2, 1)
    over = overshoot(mask.indices, SEQ_LEN, seed=world)
    assert (over > SEQ_LEN).any()
    for a in layouts(world, over, mask.causal).values():
        for rank in range(world):
            got = rebase_mask(over, causal=mask.causal, assignment_or_positions=a, rank=rank)
            want = rebase_mask(
                mask.indices, causal=mask.causal, assignment_or_positions=a, rank=rank
            )
            np.testing.assert_array_equal(got, want)
            assert got.max() <= a.positions(SEQ_LEN, rank).size
            assert_rebase_matches(over, mask.causal, a, rank)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_another_ranks_positions_do_not_match(world: int) -> None:
    """Negative check: the oracle does catch rows attributed to the wrong rank."""
    for family in ("causal", "causal_document", "sliding_window"):
        mask = FAMILIES[family](1, SEQ_LEN, 1, 0)
        dense = mask.dense()
        a = Assignment.dualchunk(world)
        for rank in range(world):
            other = (rank + 1) % world
            wrong = rebase_mask(
                mask.indices, causal=mask.causal, assignment_or_positions=a, rank=other
            )
            got = to_dense(wrong, causal=False, q_len=2 * SEQ_LEN // (2 * world))
            assert not np.array_equal(got, dense[:, :, a.positions(SEQ_LEN, rank)])


def test_causal_flag_cannot_be_kept_under_cp() -> None:
    """Negative check: rebasing values but keeping `causal=True` breaks (bottom-right causal)."""
    mask = FAMILIES["causal_document"](1, SEQ_LEN, 1, 2)
    a = Assignment.dualchunk(2)
    pos = a.positions(SEQ_LEN, 0)
    naive = rebase_thresholds(mask.indices, pos)  # still 1 column, used with causal=True
    got = to_dense(naive, causal=True, q_len=pos.size)
    assert not np.array_equal(got, mask.dense()[:, :, pos])


# --------------------------------------------------------------------------------------------
# Equality with the reference formulas.


@pytest.mark.parametrize("world", CPS)
def test_general_rule_equals_dualchunk_formula(world: int) -> None:
    s = SEQ_LEN
    c = s // (2 * world)
    g = np.arange(s + 1)  # every threshold, boundaries included: 0, chunk starts/ends, S
    for rank in range(world):
        pos = Assignment.dualchunk(world).positions(s, rank)
        np.testing.assert_array_equal(
            rebase_thresholds(g, pos), dualchunk_reference(g, rank, world, c)
        )


@pytest.mark.parametrize("world", CPS)
def test_general_rule_equals_contiguous_formula(world: int) -> None:
    s = SEQ_LEN
    c = s // world
    g = np.arange(s + 1)
    for rank in range(world):
        pos = Assignment.contiguous(world).positions(s, rank)
        np.testing.assert_array_equal(rebase_thresholds(g, pos), np.clip(g - rank * c, 0, c))


def test_boundary_thresholds_dualchunk() -> None:
    # world 2, S 16, c 4: rank 0 holds rows [0, 4) and [12, 16).
    pos = Assignment.dualchunk(2).positions(16, 0)
    g = np.array([0, 3, 4, 5, 11, 12, 13, 15, 16])
    np.testing.assert_array_equal(rebase_thresholds(g, pos), [0, 3, 4, 4, 4, 4, 5, 7, 8])


# --------------------------------------------------------------------------------------------
# Random masks and random layouts.


@st.composite
def random_masks(draw: st.DrawFn) -> tuple[np.ndarray, bool, Assignment]:
    world = draw(st.sampled_from(CPS))
    k = draw(st.integers(1, 3))
    c = draw(st.integers(1, 3))
    s = world * k * c
    causal = draw(st.booleans())
    ncol = draw(st.sampled_from((1, 2) if causal else (2, 4)))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.integers(0, s + 1, size=(2, 2, s, ncol)), axis=-1).astype(np.int32)
    if not causal and ncol == 2:  # [LTS, UTE]: independent thresholds, any order is valid
        idx = rng.integers(0, s + 1, size=(2, 2, s, 2)).astype(np.int32)
    perm = rng.permutation(world * k)
    a = Assignment.from_lists([perm[r * k : (r + 1) * k] for r in range(world)])
    return idx, causal, a


@settings(max_examples=150, deadline=None)
@given(case=random_masks())
def test_random_masks_and_assignments(case: tuple[np.ndarray, bool, Assignment]) -> None:
    idx, causal, a = case
    for rank in range(a.world):
        assert_rebase_matches(idx, causal, a, rank)


# --------------------------------------------------------------------------------------------
# Inputs.


def test_positions_argument_and_paddle_input() -> None:
    mask = FAMILIES["document"](1, 32, 1, 4)
    pos = np.array([1, 5, 6, 20, 31])
    local = rebase_mask(
        paddle.to_tensor(mask.indices), causal=False, assignment_or_positions=paddle.to_tensor(pos)
    )
    np.testing.assert_array_equal(
        to_dense(local, causal=False, q_len=pos.size), mask.dense()[:, :, pos]
    )


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([0, 2, 1], "strictly increasing"),
        ([3, 3], "strictly increasing"),
        ([0, 32], r"must lie in \[0, 32\)"),
        ([-1, 4], r"must lie in \[0, 32\)"),
    ],
)
def test_bad_positions_raise(positions: list[int], match: str) -> None:
    idx = FAMILIES["causal"](1, 32, 1, 0).indices
    with pytest.raises(ValueError, match=match):
        rebase_mask(idx, causal=True, assignment_or_positions=np.array(positions))


def test_bad_inputs_raise() -> None:
    idx = FAMILIES["causal"](1, 32, 1, 0).indices
    with pytest.raises(ValueError, match="rank is required"):
        rebase_mask(idx, causal=True, assignment_or_positions=Assignment.dualchunk(2))
    with pytest.raises(ValueError, match="rank 4"):
        rebase_mask(idx[0], causal=True, assignment_or_positions=np.arange(4))
    with pytest.raises(ValueError, match="data.seq_len"):
        rebase_mask(idx, causal=True, assignment_or_positions=Assignment.dualchunk(3), rank=0)
    with pytest.raises(ValueError, match="columns"):
        rebase_mask(idx, causal=False, assignment_or_positions=np.arange(4))
    assert local_positions(np.array([], dtype=np.int64), 8).size == 0
