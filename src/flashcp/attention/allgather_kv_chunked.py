"""All-gather-KV attention in chunks: bounded working set at millions of tokens.

The all-gather-KV algorithm (`flashcp.attention.allgather_kv`) holds the whole gathered K/V
`[B, S, Hkv, D]` and, in backward, full-length dK/dV partial sums (float32 for the
reduce-scatter), and runs one kernel call over all local queries (on GPU with FlashAttention's
own float32 dQ accumulator for all of them). At GLM-4-9B's shape and 4M global tokens on cp 8
that is ~4 GiB of K/V and ~8 GiB of float32 dK/dV per rank. This implementation runs the same
attention in chunks (`attention.query_chunk`, `attention.kv_chunk`):

* a **key chunk** j is local rows `[j·n, (j+1)·n)` of every rank (`n = kv_chunk / cp`), gathered
  in one all-gather: `kv_chunk` global keys, rank-major (rank 0's n rows, rank 1's, ...).
  Those keys are a subset of the global key columns, and a FlashMask column mask restricted to
  a subset of its columns is exactly the mask of that subset: the plan permutes the rebased
  local mask's S columns into key-chunk order once, so chunk j's mask is a slice;
* a **query chunk** i is local rows `[a, b)`: its mask rows are rebased onto the chunk
  (`flashcp.cp.rebase.rebase_rows`, the contiguous case of the CP rebase);
* **forward** (per query chunk, over the key chunks): one kernel call per (i, j) gives the
  chunk's normalised output and LSE, merged exactly through the LSEs in float32
  (`merge_partial`): ``lse = log(Σ e^lse_j)``, ``o = Σ o_j · e^(lse_j - lse)``. K/V chunks are
  gathered again for every query chunk (forward keeps no gathered K/V);
* **backward** (per key chunk, over the query chunks): FlashAttention's backward is exact on
  any key subset given the row's GLOBAL LSE and ``D = rowsum(dO ∘ O)`` from the GLOBAL output,
  so every (i, j) call gets the merged `out` and `lse` rows of chunk i. dQ accumulates in
  float32 across key chunks; a key chunk's dK/dV accumulate in float32 over the query chunks
  and are reduce-scattered to their owners as soon as the last query chunk has contributed.

What is live per rank (the planner's items, `flashcp.plan`): forward — one gathered K/V chunk
(`kv_chunk` keys × Hkv × (D + Dv) in the activation dtype, plus the all-gather's parts), the
merge accumulators of one query chunk (`query_chunk` × Hq × Dv float32 + its LSE) and one
kernel call's output; backward — the float32 dQ accumulator of all local rows (L × Hq × D × 4),
one gathered K/V chunk and its float32 dK/dV accumulators (`kv_chunk` × Hkv × (D + Dv) × 4),
one kernel call's dq/dk/dv (on GPU plus FlashAttention's own float32 dQ accumulator for
`query_chunk` rows), and the permuted mask (the rebased local mask's size, int32).

Kernels: the plan's FlashAttention version through `flashcp.kernels.registry.get_backend`, the
same backend calls as the unchunked implementation (the CPU reference kernel on CPU). A row
that sees no key of a chunk gets out 0 and LSE ±inf from the kernel (+inf from FA2/FA3, -inf
from FA4 and the CPU reference): the merge treats both as "no keys"; a row empty in every
chunk keeps the kernel's own value, as an unchunked call would give it.

Cost: the forward gathers K/V once per query chunk (`L / query_chunk` times the unchunked
all-gather bytes), the backward once; dK/dV reduce-scatter bytes are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import paddle

from flashcp.attention.allgather_kv import (
    REDUCE_DTYPE,
    CPPlan,
    check_inputs,
    plan_cp_attention,
)
from flashcp.attention.context import AttentionContext
from flashcp.attention.interface import AttentionImpl
from flashcp.cp.layout import chunk_bounds
from flashcp.cp.rebase import rebase_rows
from flashcp.distributed.collectives import all_gather_tensor, reduce_scatter_chunks
from flashcp.distributed.groups import NamedGroup
from flashcp.kernels.registry import get_backend
from flashcp.mask_indices import as_numpy
from flashcp.masks import causal_mask

ACC_DTYPE = "float32"
"""The merge accumulators, dQ and the dK/dV partial sums are float32 whatever q's dtype."""


@dataclass(frozen=True)
class ChunkedPlan(CPPlan):
    """A `CPPlan` with its chunk sizes; `mask` is the rebased local mask `[B, Hm, S, C']`
    with its columns in key-chunk order (`key_order`: chunk after chunk, rank-major)."""

    query_rows: int
    """Local query rows per kernel call."""
    key_rows: int
    """Local rows each rank contributes to one key chunk (`kv_chunk / world`)."""

    def query_bounds(self, length: int) -> list[tuple[int, int]]:
        return chunk_bounds(length, self.query_rows)

    def key_bounds(self, length: int) -> list[tuple[int, int]]:
        return chunk_bounds(length, self.key_rows)

    def chunk_mask(self, rows: tuple[int, int], keys: tuple[int, int]) -> paddle.Tensor:
        """The kernel mask of query rows `rows` against key chunk `keys` (local rows)."""
        first, last = keys[0] * self.world, keys[1] * self.world
        return rebase_rows(rows_of(self.mask, first, last, axis=2), rows[0], rows[1])


def key_order(assignment: Any, seq: int, world: int, key_rows: int) -> np.ndarray:
    """The global positions of the gathered keys, chunk after chunk: for each key chunk,
    rank 0's local rows of that chunk, then rank 1's, ... (the all-gather's order)."""
    positions = [assignment.positions(seq, r) for r in range(world)]
    local = len(positions[0])
    return np.concatenate(
        [positions[r][a:b] for a, b in chunk_bounds(local, key_rows) for r in range(world)]
    ).astype(np.int64)


def rows_of(x: paddle.Tensor, start: int, stop: int, axis: int = 1) -> paddle.Tensor:
    """Rows `[start, stop)` of `x` along `axis` as a contiguous tensor: a Paddle slice is a
    strided view, which the collectives and the GPU kernels refuse."""
    part = x[:, start:stop] if axis == 1 else x[:, :, start:stop]
    return part if part.is_contiguous() else part.contiguous()


def _one_rank() -> NamedGroup:
    """A one-rank group: chunked attention over this rank's own sequence (no CP)."""
    return NamedGroup("cp", 0, -1, [0], pg=None, name="flashcp_cp_self")


def plan_chunked(
    q: Any, k: Any, ctx: AttentionContext, *, query_chunk: int, kv_chunk: int
) -> ChunkedPlan:
    """Plan as all-gather KV does (validate, layout, rebase, FA version), then the chunks."""
    # no group means this rank's own sequence (not the world group, as for all-gather KV)
    group = ctx.group if ctx.group is not None else _one_rank()
    world = int(group.nranks)
    mask = ctx.mask
    if mask is None:
        if not ctx.causal:
            raise ValueError(
                "chunked attention (attention.query_chunk / attention.kv_chunk) needs a mask "
                "or causal=True: pass the batch's startend_row_indices"
            )
        mask = causal_mask(int(q.shape[0]), int(q.shape[1]) * world).indices
    for key, value in (("attention.query_chunk", query_chunk), ("attention.kv_chunk", kv_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} must be an integer >= 0 (0 = one chunk), got {value!r}")
    if kv_chunk % world:
        raise ValueError(
            f"attention.kv_chunk {kv_chunk} is not a multiple of the cp group's {world} ranks: "
            f"each rank contributes kv_chunk / cp of its rows to a key chunk; set "
            f"attention.kv_chunk to a multiple of parallel.cp (e.g. {-(-kv_chunk // world) * world}"
            ")"
        )
    check_inputs(q, k, k)
    base = plan_cp_attention(
        q,
        k,
        as_numpy(mask),
        group=group,
        causal=ctx.causal,
        mode=ctx.mode,
        assignment=ctx.assignment,
        fa4_unavailable=ctx.fa4_unavailable,
    )
    local = int(q.shape[1])
    seq = local * world
    key_rows = kv_chunk // world if kv_chunk else local
    order = key_order(base.assignment, seq, world, key_rows)
    # the rebased mask's columns are the global key positions: put them in key-chunk order
    permuted = paddle.index_select(base.mask, paddle.to_tensor(order, place=q.place), axis=2)
    values = {f.name: getattr(base, f.name) for f in fields(CPPlan)}
    values["mask"] = permuted
    return ChunkedPlan(
        **values,
        query_rows=query_chunk or local,
        key_rows=key_rows,
    )


def _finite_or(lse: paddle.Tensor, value: float) -> paddle.Tensor:
    return paddle.where(paddle.isfinite(lse), lse, paddle.full_like(lse, value))


def _weight(lse: paddle.Tensor, shift: paddle.Tensor) -> paddle.Tensor:
    """`e^(lse - shift)`, exactly 0 where lse is -inf: Paddle's vectorised CPU exp returns a
    denormal (~2.9e-39), not 0, for -inf, so a row without keys would get a finite LSE."""
    return paddle.where(paddle.isfinite(lse), paddle.exp(lse - shift), paddle.zeros_like(lse))


def merge_partial(
    acc: tuple[paddle.Tensor, paddle.Tensor] | None, out: paddle.Tensor, lse: paddle.Tensor
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Merge a kernel call's normalised `(out [B, n, H, D], lse [B, H, n])` over one key chunk
    into the running `(out, lse)` over the previous chunks (float32), exactly:

        lse = log(e^lse_a + e^lse_b),   out = out_a · e^(lse_a - lse) + out_b · e^(lse_b - lse)

    A row without keys in a chunk (LSE ±inf, see the module docstring) contributes nothing; a
    row without keys so far keeps LSE -inf and output 0.
    """
    out = out.astype(ACC_DTYPE)
    lse = _finite_or(lse.astype(ACC_DTYPE), -np.inf)
    if acc is None:
        return out, lse
    out_a, lse_a = acc
    top = paddle.maximum(lse_a, lse)
    shift = _finite_or(top, 0.0)  # rows without keys anywhere yet: e^(-inf - 0) = 0, no NaN
    wa, wb = _weight(lse_a, shift), _weight(lse, shift)
    total = wa + wb
    seen = total > 0
    safe = paddle.where(seen, total, paddle.ones_like(total))
    merged = paddle.where(seen, shift + paddle.log(safe), paddle.full_like(total, -np.inf))
    wa, wb = wa / safe, wb / safe  # 0 where no keys were seen (both terms are 0)

    def per_row(w: paddle.Tensor) -> paddle.Tensor:  # [B, H, n] → [B, n, H, 1]
        return w.transpose([0, 2, 1]).unsqueeze(-1)

    return out_a * per_row(wa) + out * per_row(wb), merged


class AllGatherKVChunked(AttentionImpl[ChunkedPlan]):
    """All-gather K/V in chunks of global keys, the local queries in chunks, LSE-merged."""

    name = "allgather_kv_chunked"

    def plan(self, q: Any, k: Any, v: Any, ctx: AttentionContext) -> ChunkedPlan:
        check_inputs(q, k, v)
        return plan_chunked(q, k, ctx, query_chunk=ctx.query_chunk, kv_chunk=ctx.kv_chunk)

    def forward(self, q: Any, k: Any, v: Any, plan: ChunkedPlan) -> tuple[Any, Any]:
        """Per query chunk, over the key chunks: kernel forward, LSE merge (no autograd)."""
        backend = get_backend(plan.version, plan.device)
        b, length, heads = (int(s) for s in q.shape[:3])
        out = paddle.empty([b, length, heads, int(v.shape[3])], dtype=q.dtype)
        lse = paddle.empty([b, heads, length], dtype=ACC_DTYPE)
        keys = plan.key_bounds(length)
        for rows in plan.query_bounds(length):
            qi = rows_of(q, *rows)
            acc, first = None, None
            for kb in keys:
                kj, vj = gather_rows(k, kb, plan), gather_rows(v, kb, plan)
                o, l = backend.forward(
                    qi, kj, vj, plan.chunk_mask(rows, kb), causal=False, softmax_scale=plan.scale
                )
                del kj, vj
                first = l if first is None else first
                acc = merge_partial(acc, o, l)
                del o, l
            assert acc is not None and first is not None
            merged = paddle.where(paddle.isfinite(acc[1]), acc[1], first.astype(ACC_DTYPE))
            out[:, rows[0] : rows[1]] = acc[0].astype(q.dtype)
            lse[:, :, rows[0] : rows[1]] = merged
            del acc, first, merged
        return out, lse

    def backward(
        self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, plan: ChunkedPlan
    ) -> tuple[Any, Any, Any]:
        """Per key chunk, over the query chunks: kernel backward on the GLOBAL out/LSE rows;
        dQ in float32 across key chunks; each key chunk's dK/dV reduce-scattered once done."""
        backend = get_backend(plan.version, plan.device)
        length = int(q.shape[1])
        dq = paddle.zeros(q.shape, dtype=ACC_DTYPE)
        dk, dv = paddle.empty(k.shape, dtype=k.dtype), paddle.empty(v.shape, dtype=v.dtype)
        queries = plan.query_bounds(length)
        for kb in plan.key_bounds(length):
            kj, vj = gather_rows(k, kb, plan), gather_rows(v, kb, plan)
            dkj = dvj = None
            for a, b in queries:
                dqi, dki, dvi = backend.backward(
                    rows_of(q, a, b),
                    kj,
                    vj,
                    rows_of(out, a, b),
                    rows_of(lse, a, b, axis=2),
                    plan.chunk_mask((a, b), kb),
                    rows_of(dout, a, b),
                    causal=False,
                    softmax_scale=plan.scale,
                )
                dq[:, a:b] = dq[:, a:b] + dqi.astype(ACC_DTYPE)
                dkj = dki.astype(ACC_DTYPE) if dkj is None else dkj + dki.astype(ACC_DTYPE)
                dvj = dvi.astype(ACC_DTYPE) if dvj is None else dvj + dvi.astype(ACC_DTYPE)
                del dqi, dki, dvi
            del kj, vj
            assert dkj is not None and dvj is not None
            dk[:, kb[0] : kb[1]] = scatter_rows(dkj, plan).astype(k.dtype)
            dv[:, kb[0] : kb[1]] = scatter_rows(dvj, plan).astype(v.dtype)
            del dkj, dvj
        return (dq if dq.dtype == q.dtype else dq.astype(q.dtype)), dk, dv


def gather_rows(x: paddle.Tensor, rows: tuple[int, int], plan: ChunkedPlan) -> paddle.Tensor:
    """Every rank's local rows `[a, b)` of K or V, rank-major `[B, world·(b-a), H, D]`."""
    part = rows_of(x, *rows)
    return part if plan.world == 1 else all_gather_tensor(part, plan.group, axis=1)


def scatter_rows(partial: paddle.Tensor, plan: ChunkedPlan) -> paddle.Tensor:
    """A key chunk's rank-major partial dK or dV (float32) → the sum over ranks of this rank's
    own rows of the chunk (reduce-scatter, in float32 like `allgather_kv.scatter_grad`)."""
    if plan.world == 1:
        return partial
    assert str(partial.dtype).endswith(REDUCE_DTYPE)
    width = int(partial.shape[1]) // plan.world
    parts = [rows_of(partial, r * width, (r + 1) * width) for r in range(plan.world)]
    return reduce_scatter_chunks(parts, plan.group)


ALLGATHER_KV_CHUNKED = AllGatherKVChunked()
"""The one chunked all-gather-KV implementation (stateless; the registry names it)."""
