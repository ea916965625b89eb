"""CP sequence layouts: assignments, shard/unshard round trips, positions, padding."""

from __future__ import annotations

import re

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.cp.layout import (
    Assignment,
    assigned_positions,
    contiguous_positions,
    dualchunk_positions,
    pad_mask,
    pad_to_multiple,
    padded_length,
    shard_assigned,
    shard_contiguous,
    shard_dualchunk,
    unshard_assigned,
    unshard_contiguous,
    unshard_dualchunk,
)
from flashcp.mask_families import FAMILIES
from flashcp.mask_indices import to_dense, validate
from helpers.maskcases import overshoot


@st.composite
def assignments(draw: st.DrawFn, max_world: int = 6, max_k: int = 4) -> Assignment:
    """A random valid assignment: a random permutation of chunks dealt to ranks."""
    world = draw(st.integers(1, max_world))
    k = draw(st.integers(1, max_k))
    perm = draw(st.permutations(range(world * k)))
    return Assignment.from_lists([perm[r * k : (r + 1) * k] for r in range(world)])


# --------------------------------------------------------------------------------------------
# Assignment


def test_dualchunk_and_contiguous_are_assignments() -> None:
    assert Assignment.dualchunk(4).ranks == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert Assignment.dualchunk(4).num_chunks == 8
    assert Assignment.dualchunk(1).ranks == ((0, 1),)
    assert Assignment.contiguous(3).ranks == ((0,), (1,), (2,))
    a = Assignment.dualchunk(3)
    assert (a.world, a.chunks_per_rank) == (3, 2)
    np.testing.assert_array_equal(a.owners(), [0, 1, 2, 2, 1, 0])


def test_from_lists_sorts_each_rank() -> None:
    a = Assignment.from_lists([[5, 0], [3, 1], [2, 4]])
    assert a.ranks == ((0, 5), (1, 3), (2, 4))
    assert a.runs(2) == [(2, 1), (4, 1)]
    assert Assignment.from_lists([[1, 2, 3], [0, 4, 5]]).runs(1) == [(0, 1), (4, 2)]


@pytest.mark.parametrize(
    ("ranks", "num_chunks", "match"),
    [
        (((0, 1), (2,)), 3, "same, non-zero number"),
        (((0, 1), (1, 2)), 4, "exactly once"),
        (((0, 1), (2, 3)), 5, "exactly once"),
        (((1, 0), (2, 3)), 4, "increasing order"),
        ((), 0, "at least one rank"),
    ],
)
def test_invalid_assignments_raise(ranks: tuple, num_chunks: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Assignment(ranks=ranks, num_chunks=num_chunks)


def test_bad_world_and_rank_raise() -> None:
    with pytest.raises(ValueError, match="world size"):
        Assignment.dualchunk(0)
    with pytest.raises(ValueError, match="out of range"):
        Assignment.dualchunk(2).positions(8, 2)


@pytest.mark.parametrize(
    ("assignment", "seq_len", "message"),
    [
        (
            Assignment.dualchunk(4),
            1001,
            re.escape(
                "seq_len 1001 is not divisible by 2·cp = 8: set data.seq_len to a multiple of 8 "
                "(e.g. 1001→1008) or set parallel.pad: true"
            ),
        ),
        (
            Assignment.dualchunk(16),
            1000,
            re.escape(
                "seq_len 1000 is not divisible by 2·cp = 32: set data.seq_len to a multiple of "
                "32 (e.g. 1000→1024) or set parallel.pad: true"
            ),
        ),
        (Assignment.contiguous(3), 1000, "not divisible by cp = 3:.*1000→1002"),
        (
            Assignment.from_lists([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]),
            1000,
            "cp·chunks_per_rank = 4·3 = 12:.*1000→1008",
        ),
    ],
)
def test_indivisible_seq_len_names_the_config_key(
    assignment: Assignment, seq_len: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        assignment.chunk_len(seq_len)
    x = np.zeros((1, seq_len))
    with pytest.raises(ValueError, match="data.seq_len"):
        shard_assigned(x, 0, assignment)


# --------------------------------------------------------------------------------------------
# Positions


def test_named_positions() -> None:
    np.testing.assert_array_equal(dualchunk_positions(16, 1, 4), [2, 3, 12, 13])
    np.testing.assert_array_equal(dualchunk_positions(8, 0, 1), np.arange(8))
    np.testing.assert_array_equal(contiguous_positions(12, 2, 3), [8, 9, 10, 11])
    assert dualchunk_positions(16, 1, 4).dtype == np.int64


@settings(max_examples=60, deadline=None)
@given(a=assignments(), c=st.integers(1, 5))
def test_positions_partition_the_sequence(a: Assignment, c: int) -> None:
    s = a.num_chunks * c
    pos = [assigned_positions(s, r, a) for r in range(a.world)]
    for p in pos:
        assert p.size == a.chunks_per_rank * c
        assert np.all(np.diff(p) > 0)  # sorted chunk lists keep local rows increasing
    np.testing.assert_array_equal(np.sort(np.concatenate(pos)), np.arange(s))


# --------------------------------------------------------------------------------------------
# Shard / unshard


@settings(max_examples=60, deadline=None)
@given(a=assignments(), c=st.integers(1, 3), axis=st.sampled_from([0, 1, 2, -1]))
def test_shard_round_trip_numpy(a: Assignment, c: int, axis: int) -> None:
    shape = [2, 3, 4]
    shape[axis] = a.num_chunks * c
    x = np.random.default_rng(0).standard_normal(shape)
    shards = [shard_assigned(x, r, a, axis=axis) for r in range(a.world)]
    for r, shard in enumerate(shards):
        np.testing.assert_array_equal(
            shard, np.take(x, assigned_positions(x.shape[axis], r, a), axis=axis)
        )
        assert not np.shares_memory(shard, x)
    np.testing.assert_array_equal(unshard_assigned(shards, a, axis=axis), x)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_dualchunk_is_chunks_r_and_mirror(world: int) -> None:
    s = 2 * world * 3
    x = np.arange(2 * s * 5).reshape(2, s, 5)
    c = s // (2 * world)
    for r in range(world):
        mirror = 2 * world - 1 - r
        expect = np.concatenate([x[:, r * c : (r + 1) * c], x[:, mirror * c : (mirror + 1) * c]], 1)
        np.testing.assert_array_equal(shard_dualchunk(x, r, world), expect)
    shards = [shard_dualchunk(x, r, world) for r in range(world)]
    np.testing.assert_array_equal(unshard_dualchunk(shards, world), x)


def test_contiguous_shard_is_a_copy() -> None:
    x = np.arange(24).reshape(2, 12)
    shard = shard_contiguous(x, 1, 3)
    np.testing.assert_array_equal(shard, x[:, 4:8])
    assert not np.shares_memory(shard, x)
    shards = [shard_contiguous(x, r, 3) for r in range(3)]
    np.testing.assert_array_equal(unshard_contiguous(shards, 3), x)


def test_paddle_shard_round_trip_copy_and_grad() -> None:
    world = 2
    x_np = np.random.default_rng(1).standard_normal((2, 8, 3, 4)).astype("float32")
    x = paddle.to_tensor(x_np, stop_gradient=False)
    shards = [shard_dualchunk(x, r, world) for r in range(world)]
    assert isinstance(shards[0], paddle.Tensor)
    np.testing.assert_array_equal(shards[1].numpy(), x_np[:, [2, 3, 4, 5]])
    np.testing.assert_array_equal(unshard_dualchunk(shards, world).numpy(), x_np)
    np.testing.assert_array_equal(shard_contiguous(x, 1, 2).numpy(), x_np[:, 4:])
    # Gradients flow back to the right global positions.
    weights = [paddle.full(s.shape, float(r + 1)) for r, s in enumerate(shards)]
    sum(((s * w).sum() for s, w in zip(shards, weights, strict=True)), paddle.zeros([])).backward()
    grad = x.grad.numpy()[0, :, 0, 0]
    np.testing.assert_array_equal(grad, [1, 1, 2, 2, 2, 2, 1, 1])
    # A copy: changing the source afterwards leaves the shard alone.
    y = paddle.arange(8, dtype="float32").reshape([1, 8])
    shard = shard_contiguous(y, 0, 2)
    y[0, 0] = 100.0
    assert float(shard[0, 0]) == 0.0


def test_unshard_rejects_bad_input() -> None:
    a = Assignment.dualchunk(2)
    x = np.arange(8).reshape(1, 8)
    shards = [shard_assigned(x, r, a) for r in range(2)]
    with pytest.raises(ValueError, match="expected 2 shards"):
        unshard_assigned(shards[:1], a)
    with pytest.raises(ValueError, match="same shape"):
        unshard_assigned([shards[0], shards[1][:, :2]], a)
    with pytest.raises(ValueError, match="not divisible by chunks_per_rank 2"):
        unshard_assigned([x[:, :3], x[:, 3:6]], a)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        shard_assigned(x, 0, a, axis=3)


# --------------------------------------------------------------------------------------------
# Padding


def test_padded_length_and_pad_to_multiple() -> None:
    assert [padded_length(n, 8) for n in (1, 8, 9, 1000)] == [8, 8, 16, 1000]
    with pytest.raises(ValueError, match="multiple"):
        padded_length(3, 0)
    x = np.ones((2, 5, 3), dtype=np.float32)
    y = pad_to_multiple(x, 4, axis=1, value=-1)
    assert y.shape == (2, 8, 3) and y.dtype == np.float32
    np.testing.assert_array_equal(y[:, :5], x)
    assert (y[:, 5:] == -1).all()
    assert pad_to_multiple(x, 5, axis=1) is x
    t = pad_to_multiple(paddle.ones([2, 5], dtype="int64"), 4, axis=-1, value=7)
    assert t.shape == [2, 8] and t.dtype == paddle.int64
    np.testing.assert_array_equal(t.numpy()[:, 5:], 7)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seq_len", [13, 37])
def test_pad_mask_keeps_real_rows_and_masks_padding_columns(family: str, seq_len: int) -> None:
    mask = FAMILIES[family](2, seq_len, 2, 3)
    new_len = padded_length(seq_len, 16)
    padded = pad_mask(mask.indices, new_len, causal=mask.causal)
    assert padded.dtype == np.int32
    assert padded.shape == (*mask.indices.shape[:2], new_len, mask.indices.shape[3])
    validate(padded, causal=mask.causal)  # FlashMask's own rules still hold
    dense = to_dense(padded, causal=mask.causal)
    np.testing.assert_array_equal(dense[:, :, :seq_len, :seq_len], mask.dense())
    assert dense[:, :, :, seq_len:].all()  # no row ever sees a padding key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pad_mask_reads_values_beyond_seq_as_the_end(family: str) -> None:
    """A threshold > S means "through the last row" like S itself (upstream), so it must also
    become `new_len`: padded rows then see exactly what they see for the S-valued mask."""
    mask = FAMILIES[family](2, 37, 2, 3)
    over = overshoot(mask.indices, 37, seed=4)
    assert (over > 37).any()
    np.testing.assert_array_equal(
        pad_mask(over, 48, causal=mask.causal), pad_mask(mask.indices, 48, causal=mask.causal)
    )


def test_pad_mask_rejects_bad_input() -> None:
    idx = FAMILIES["causal"](1, 8, 1, 0).indices
    with pytest.raises(ValueError, match="shorter"):
        pad_mask(idx, 4, causal=True)
    with pytest.raises(ValueError, match="not valid with causal=False"):
        pad_mask(idx, 16, causal=False)
    with pytest.raises(ValueError, match="rank 4"):
        pad_mask(idx[0], 16, causal=True)
    np.testing.assert_array_equal(pad_mask(idx, 8, causal=True), idx)
