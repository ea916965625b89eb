"""CP dK/dV reduction precision (issue 13 point 5): bf16 partial sums are reduced in float32.

Each CP rank's backward produces full-length dK/dV partial sums in the kernel's dtype (bf16 on
GPU). `scatter_grad` must widen them to float32, reduce-scatter, and cast the sum back once.
The reduce-scatter is replaced by an in-process ring over simulated ranks that adds in the
dtype it is handed (bf16 arithmetic emulated as "add in float32, round to bf16", which is what
a bf16 NCCL ring does per step; Paddle's CPU build has no bf16 add kernel), so the test measures
exactly the precision `scatter_grad` chose.

Tolerance, per element, against the exact (float64) sum of the bf16-stored partials x_r over
P ranks: a float32 sequential sum errs by at most (P - 1) · 2^-24 · Σ|x_r|, and the single cast
to bf16 by at most 2^-8 · |result| (bf16 unit roundoff), so

    tol = 2^-8 · |exact| + (1 + 2^-8) · (P - 1) · 2^-24 · Σ|x_r|.

The negative control reduces the same partials in bf16 and must exceed it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.attention import allgather_kv as cp_attention
from flashcp.attention.allgather_kv import CPPlan, scatter_grad
from flashcp.cp.layout import Assignment, shard_assigned

U_BF16 = 2.0**-8
U_FP32 = 2.0**-24


class _Rank:
    """The two attributes of a process group the plan reads."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.nranks = rank, world


def _plan(rank: int, world: int) -> CPPlan:
    return CPPlan(
        version=2,
        device="cpu",
        mask=None,
        causal=False,
        scale=1.0,
        group=_Rank(rank, world),
        rank=rank,
        world=world,
        assignment=Assignment.dualchunk(world),
    )


def _ring_in(dtype: Any, chunks: list[Any], others: list[list[Any]], me: int) -> Any:
    """Sum of chunk `me` over ranks, added one rank at a time in `dtype`."""
    world = len(others)
    acc = chunks[me]
    for step in range(1, world):
        incoming = others[(me - step) % world][me]
        total = acc.astype("float32") + incoming.astype("float32")
        acc = total.astype(dtype)
    return acc


@pytest.fixture
def partials() -> list[paddle.Tensor]:
    """8 ranks' full-length bf16 dK partials [B=1, S=256, H=2, D=16]."""
    rng = np.random.default_rng(13)
    return [
        paddle.to_tensor(rng.standard_normal((1, 256, 2, 16)).astype(np.float32)).astype(
            "bfloat16"
        )
        for _ in range(8)
    ]


def _exact_and_tol(partials: list[paddle.Tensor], rank: int) -> tuple[np.ndarray, np.ndarray]:
    world = len(partials)
    asg = Assignment.dualchunk(world)
    mine = [
        shard_assigned(p.astype("float32"), rank, asg, axis=1).numpy().astype(np.float64)
        for p in partials
    ]
    exact = np.sum(mine, axis=0)
    magnitude = np.sum(np.abs(mine), axis=0)
    tol = U_BF16 * np.abs(exact) + (1 + U_BF16) * (world - 1) * U_FP32 * magnitude
    return exact, tol


def _run(partials: list[paddle.Tensor], rank: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    world = len(partials)
    asg = Assignment.dualchunk(world)
    seen: list[Any] = []

    def fake_reduce_scatter(chunks: list[Any], group: Any) -> Any:
        dtype = chunks[0].dtype
        seen.append(dtype)
        # every other rank ran the same scatter_grad: its chunks come in the same dtype
        others = [
            [shard_assigned(p.astype(dtype), r, asg, axis=1) for r in range(world)]
            for p in partials
        ]
        others[group.rank] = list(chunks)
        return _ring_in(dtype, list(chunks), others, group.rank)

    monkeypatch.setattr(cp_attention, "reduce_scatter_chunks", fake_reduce_scatter)
    out = scatter_grad(partials[rank], _plan(rank, world))
    assert seen == [paddle.float32], "the reduce-scatter must run in float32"
    return out


@pytest.mark.parametrize("rank", [0, 5])
def test_bf16_partials_are_reduced_in_float32(partials, rank, monkeypatch) -> None:
    out = _run(partials, rank, monkeypatch)
    assert out.dtype == paddle.bfloat16  # cast back once, to the kernel's dtype
    exact, tol = _exact_and_tol(partials, rank)
    err = np.abs(out.astype("float32").numpy().astype(np.float64) - exact)
    assert np.all(err <= tol), f"worst err/tol {np.max(err / tol):.2f}"


def test_negative_control_bf16_ring_exceeds_the_float32_bound(partials) -> None:
    """Reducing the same partials in bf16 (the old behaviour) breaks the bound."""
    world, rank = len(partials), 0
    asg = Assignment.dualchunk(world)
    others = [[shard_assigned(p, r, asg, axis=1) for r in range(world)] for p in partials]
    bf16_sum = _ring_in(paddle.bfloat16, others[rank], others, rank)
    exact, tol = _exact_and_tol(partials, rank)
    err = np.abs(bf16_sum.astype("float32").numpy().astype(np.float64) - exact)
    assert np.max(err / tol) > 2.0


def test_float32_partials_keep_their_dtype(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    parts = [paddle.to_tensor(rng.standard_normal((1, 32, 1, 4)).astype(np.float32))
             for _ in range(2)]  # fmt: skip
    out = _run(parts, 1, monkeypatch)
    assert out.dtype == paddle.float32
    asg = Assignment.dualchunk(2)
    want = sum(shard_assigned(p, 1, asg, axis=1).numpy() for p in parts)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2 * U_FP32 * np.abs(want).max())
