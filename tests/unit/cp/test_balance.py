"""Workload-balanced CP: per-chunk work, the chunk assignment, imbalance, and the bench."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import cp as bench
from bench.cp_pages import balance_table
from flashcp.cp.balance import (
    assign_chunks,
    assignment_loads,
    balanced_assignment,
    chunk_work,
    imbalance,
    rank_work,
)
from flashcp.cp.layout import Assignment
from flashcp.mask_families import FAMILIES
from flashcp.mask_indices import TILE_MASKED, classify_tiles, to_dense

S = 128
BLOCK = 8


def dense_pairs_per_chunk(idx: np.ndarray, causal: bool, num_chunks: int) -> np.ndarray:
    """Oracle: unmasked (row, column) pairs per row chunk, from the dense mask."""
    visible = ~to_dense(idx, causal=causal)
    return visible.sum(axis=(0, 1, 3)).reshape(num_chunks, -1).sum(-1).astype(np.float64)


def optimum(work: np.ndarray, world: int) -> float:
    """Brute-force minimum max-load over equal-count assignments (small inputs only)."""
    k = work.size // world
    best = np.inf

    def rec(rest: list[int], top: float) -> None:
        nonlocal best
        if not rest:
            best = min(best, top)
            return
        for comb in itertools.combinations(rest[1:], k - 1):
            group = (rest[0], *comb)
            load = max(top, float(work[list(group)].sum()))
            if load < best:
                rec([c for c in rest if c not in group], load)

    rec(list(range(work.size)), 0.0)
    return best


# --------------------------------------------------------------------------------------------
# chunk_work


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pairs_unit_matches_dense_oracle(family: str) -> None:
    mask = FAMILIES[family](2, S, 2, 5)
    for n in (1, 2, 4, 16):
        got = chunk_work(mask.indices, causal=mask.causal, num_chunks=n, unit="pairs")
        np.testing.assert_array_equal(got, dense_pairs_per_chunk(mask.indices, mask.causal, n))


@settings(max_examples=80, deadline=None)
@given(
    causal=st.booleans(),
    ncol_hi=st.booleans(),
    n=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pairs_unit_on_random_masks(causal: bool, ncol_hi: bool, n: int, seed: int) -> None:
    s = 32
    ncol = (2 if ncol_hi else 1) if causal else (4 if ncol_hi else 2)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, s + 1, size=(2, 1, s, ncol)).astype(np.int32)
    if ncol != 2 or causal:
        idx = np.sort(idx, axis=-1)  # ranges [start, end) ordered
    got = chunk_work(idx, causal=causal, num_chunks=n, unit="pairs")
    np.testing.assert_array_equal(got, dense_pairs_per_chunk(idx, causal, n))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiles_unit_matches_global_tile_classification(family: str) -> None:
    """With chunk length a multiple of the tile, a chunk's tiles are the global tiles' rows."""
    mask = FAMILIES[family](2, S, 2, 6)
    tiles = classify_tiles(mask.indices, causal=mask.causal, block_q=BLOCK, block_k=BLOCK)
    computed_per_qblock = (tiles != TILE_MASKED).sum(axis=(0, 1, 3))
    dense = ~to_dense(mask.indices, causal=mask.causal)
    nb = S // BLOCK
    nonempty = dense.reshape(2, 2, nb, BLOCK, nb, BLOCK).any(axis=(3, 5)).sum(axis=(0, 1, 3))
    for n in (1, 4, 16):
        got = chunk_work(mask.indices, causal=mask.causal, num_chunks=n, block=BLOCK)
        np.testing.assert_array_equal(got, computed_per_qblock.reshape(n, -1).sum(-1))
        # Every tile holding a visible entry is computed (classification is conservative).
        assert np.all(got >= nonempty.reshape(n, -1).sum(-1))


def test_partial_weight_and_batch_sum() -> None:
    mask = FAMILIES["causal_document"](2, S, 1, 0)
    w1 = chunk_work(mask.indices, causal=True, num_chunks=8, block=BLOCK)
    w2 = chunk_work(mask.indices, causal=True, num_chunks=8, block=BLOCK, partial_weight=2.0)
    tiles = classify_tiles(mask.indices, causal=True, block_q=BLOCK, block_k=BLOCK)
    partial = (tiles == 1).sum(axis=(0, 1, 3)).reshape(8, -1).sum(-1)
    np.testing.assert_array_equal(w2 - w1, partial)
    # A batch shares one assignment: its work is the sum over its sequences.
    parts = [
        chunk_work(mask.indices[b : b + 1], causal=True, num_chunks=8, block=BLOCK) for b in (0, 1)
    ]
    np.testing.assert_array_equal(w1, parts[0] + parts[1])


def test_rank_work_equals_chunk_sums_when_aligned() -> None:
    for family in ("causal", "share_question", "global_sliding_window", "document"):
        mask = FAMILIES[family](1, S, 1, 1)
        for a in (
            Assignment.dualchunk(4),
            Assignment.contiguous(4),
            Assignment.from_lists([[0, 5, 9, 12], [1, 2, 11, 15], [3, 4, 10, 13], [6, 7, 8, 14]]),
        ):
            per_chunk = chunk_work(
                mask.indices, causal=mask.causal, num_chunks=a.num_chunks, block=BLOCK
            )
            np.testing.assert_array_equal(
                rank_work(mask.indices, causal=mask.causal, assignment=a, block=BLOCK),
                assignment_loads(per_chunk, a),
            )


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("unit", ["tiles", "pairs"])
def test_causal_dualchunk_is_exactly_balanced(world: int, unit: str) -> None:
    mask = FAMILIES["causal"](1, 256, 1, 0)
    a = Assignment.dualchunk(world)
    work = rank_work(mask.indices, causal=True, assignment=a, block=BLOCK, unit=unit)  # type: ignore[arg-type]
    assert imbalance(work) == 1.0
    if world > 1:  # and the contiguous layout is not
        cont = rank_work(
            mask.indices, causal=True, assignment=Assignment.contiguous(world), block=BLOCK
        )
        assert imbalance(cont) > 1.4


def test_imbalance() -> None:
    assert imbalance([2, 2, 2]) == 1.0
    assert imbalance([3, 1]) == 1.5
    assert imbalance(np.zeros(4)) == 1.0


# --------------------------------------------------------------------------------------------
# assign_chunks / balanced_assignment


@settings(max_examples=120, deadline=None)
@given(
    world=st.integers(1, 3),
    k=st.integers(1, 3),
    data=st.data(),
)
def test_assignment_is_valid_deterministic_and_near_optimal(
    world: int, k: int, data: st.DataObject
) -> None:
    work = np.array(
        data.draw(st.lists(st.integers(0, 50), min_size=world * k, max_size=world * k)), dtype=float
    )
    a = assign_chunks(work, world)
    assert a.world == world and a.chunks_per_rank == k and a.num_chunks == world * k
    assert assign_chunks(work.copy(), world) == a  # every rank computes the same answer
    loads = assignment_loads(work, a)
    assert loads.sum() == work.sum()
    assert loads.max() <= 4 / 3 * optimum(work, world) + 1e-9


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 6), k=st.integers(2, 5), seed=st.integers(0, 2**31 - 1))
def test_assignment_is_a_swap_local_optimum(world: int, k: int, seed: int) -> None:
    """No swap between a most-loaded rank and another lowers both below the maximum."""
    work = np.random.default_rng(seed).integers(0, 100, size=world * k).astype(float)
    a = assign_chunks(work, world)
    loads = assignment_loads(work, a)
    for m in np.flatnonzero(loads == loads.max()):
        for r in range(world):
            for x, y in itertools.product(a.ranks[m], a.ranks[r]):
                d = work[x] - work[y]
                assert not (d > 0 and max(loads[m] - d, loads[r] + d) < loads[m])


def test_ties_are_broken_by_chunk_then_rank_id() -> None:
    assert assign_chunks(np.ones(6), 3).ranks == ((0, 3), (1, 4), (2, 5))
    assert assign_chunks(np.zeros(4), 1).ranks == ((0, 1, 2, 3),)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_causal_balanced_is_dualchunk(world: int) -> None:
    mask = FAMILIES["causal"](1, 256, 1, 0)
    a = balanced_assignment(mask.indices, causal=True, world=world, block=BLOCK)
    assert a == Assignment.dualchunk(world)


@pytest.mark.parametrize(
    ("family", "seed"), [("share_question", 0), ("share_question", 1), ("causal_document", 2)]
)
def test_balanced_beats_dualchunk_on_packed_masks(family: str, seed: int) -> None:
    mask = FAMILIES[family](2, 4096, 1, seed)
    dual = rank_work(mask.indices, causal=mask.causal, assignment=Assignment.dualchunk(4))
    a = balanced_assignment(mask.indices, causal=mask.causal, world=4, chunks_per_rank=4)
    bal = rank_work(mask.indices, causal=mask.causal, assignment=a)
    assert imbalance(bal) <= 1.05 < imbalance(dual)


def test_paddle_input_gives_the_same_assignment() -> None:
    mask = FAMILIES["document"](2, S, 2, 3)
    a = balanced_assignment(mask.indices, causal=False, world=4, chunks_per_rank=4, block=BLOCK)
    b = balanced_assignment(
        paddle.to_tensor(mask.indices), causal=False, world=4, chunks_per_rank=4, block=BLOCK
    )
    assert a == b


def test_bad_arguments_raise() -> None:
    idx = FAMILIES["causal"](1, 100, 1, 0).indices
    with pytest.raises(
        ValueError, match=r"cp·chunks_per_rank = 4·3 = 12: set data.seq_len .*100→108"
    ):
        balanced_assignment(idx, causal=True, world=4, chunks_per_rank=3)
    with pytest.raises(ValueError, match=r"2·cp = 8: set data.seq_len"):
        balanced_assignment(idx, causal=True, world=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        balanced_assignment(idx, causal=True, world=2, chunks_per_rank=0)
    with pytest.raises(ValueError, match="unit must be"):
        chunk_work(idx, causal=True, num_chunks=2, unit="flops")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be split equally"):
        assign_chunks(np.ones(5), 2)
    with pytest.raises(ValueError, match="expected"):
        assignment_loads(np.ones(3), Assignment.dualchunk(2))


# --------------------------------------------------------------------------------------------
# scripts/bench_cp.py --part balance (smoke)


def test_bench_balance_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = bench.run_balance(
        families=["causal", "share_question_packed"],
        cps=[2, 4],
        seq_len=2048,
        batch=1,
        heads=1,
        seed=0,
        block=64,
        chunks_per_rank=[2, 4],
        target=1.05,
    )
    rows = {(r["family"], r["cp"], r["mode"], r["chunks_per_rank"]): r for r in result["rows"]}
    assert rows[("causal", 4, "dualchunk", 2)]["imbalance"] == 1.0
    assert rows[("causal", 4, "contiguous", 1)]["imbalance"] > 1.5
    assert result["needed_chunks_per_rank"]["causal"] == {"2": 2, "4": 2}
    abl = result["ablation"]
    assert abl and {"balanced", "lpt_only", "by_pairs"} <= set(abl[0])
    assert all(r["balanced"] <= r["lpt_only"] + 1e-9 for r in abl)
    md = balance_table(result)
    assert "| causal | 4 | " in md and "share_question_packed" in md
    # the page is generated from the JSON alone: written, then regenerated identically
    bench.write_outputs(tmp_path, "cp_balance.json", result)
    page = (tmp_path / "cp_balance.md").read_text()
    assert md in page and "computed (model)" in page and "Not run yet" in page
    assert bench.main(["--part", "docs", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "cp_balance.md").read_text() == page
    assert (
        bench.main(
            [
                "--part",
                "balance",
                "--seq-len",
                "512",
                "--cp",
                "2",
                "--chunks-per-rank",
                "2",
                "--block",
                "64",
                "--families",
                "causal",
                "--no-write",
            ]
        )
        == 0
    )
    assert "| causal | 2 | " in capsys.readouterr().out
