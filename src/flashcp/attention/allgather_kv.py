"""All-gather-KV context-parallel FlashMask attention (Llama 3 / PaddleFleet style).

`AllGatherKV` is the `AttentionImpl` every registered CP mode runs today (their layouts
differ, `flashcp.attention.registry`); `flashmask_attention_cp` is its public function.

Plan (`plan_cp_attention`, before compute): validate this rank's shards and the GLOBAL mask,
take the layout (the context's `Assignment`, or the mode's from the registry), rebase the
mask's row thresholds onto this rank's local query rows, and resolve the FlashAttention
version once.

Forward: all-gather the local K/V shards into global order and run ONE FlashMask call (local
Q against all keys, causality expressed in the mask, `causal=False`). Every rank sees every
key, so output and LSE are exact; no LSE merging.

Backward: re-gather K/V (they are not saved), run the backend's backward with the planned
version (dq is local and final; dK/dV are full-length partial sums) and reduce-scatter dK/dV
back to their owners in the same layout. LSE is an output for inspection, not differentiated
(as in FlashAttention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from flashcp import fa_dispatch
from flashcp.attention import registry
from flashcp.attention.context import AttentionContext
from flashcp.attention.interface import AttentionImpl, AttentionPlan
from flashcp.cp.layout import Assignment, shard_assigned, unshard_assigned
from flashcp.cp.rebase import rebase_mask
from flashcp.distributed.collectives import all_gather_tensor, reduce_scatter_chunks
from flashcp.distributed.groups import world_group
from flashcp.kernels.base import resolve_scale
from flashcp.kernels.registry import device_of, get_backend
from flashcp.mask_indices import as_numpy, validate


@dataclass(frozen=True)
class CPPlan(AttentionPlan):
    """An `AttentionPlan` plus the CP group and layout; `mask` is the rebased local mask
    (int32 `[B, Hm, S, C']` for the local query rows, non-causal)."""

    group: Any  # a paddle Group (resolved by `resolve_group`), or None for a single rank
    rank: int
    world: int
    assignment: Assignment


def gather_kv(x: paddle.Tensor, plan: CPPlan) -> paddle.Tensor:
    """Local K or V shard [B, L, H, D] → global [B, S, H, D] in global token order."""
    if plan.world == 1:
        return unshard_assigned([x], plan.assignment, axis=1)
    gathered = all_gather_tensor(x, plan.group, axis=1)
    return unshard_assigned(paddle.split(gathered, plan.world, axis=1), plan.assignment, axis=1)


REDUCE_DTYPE = "float32"
"""dK/dV partial sums are reduced over CP ranks in this dtype (as PaddleFormers does)."""


def scatter_grad(full: paddle.Tensor, plan: CPPlan) -> paddle.Tensor:
    """Full-length partial dK or dV → the sum over ranks of this rank's own chunks.

    Half-precision partials (bf16/fp16 from the GPU kernels) are widened to float32 before
    the reduce-scatter and the sum is cast back once, so the reduction adds float32 rounding
    (about cp · 2^-24 relative), not one bf16 rounding (2^-9) per rank.
    """
    if plan.world == 1:
        return shard_assigned(full, 0, plan.assignment, axis=1)
    dtype = full.dtype
    wide = full if dtype in (paddle.float32, paddle.float64) else full.astype(REDUCE_DTYPE)
    chunks = [shard_assigned(wide, r, plan.assignment, axis=1) for r in range(plan.world)]
    summed = reduce_scatter_chunks(chunks, plan.group)
    return summed if summed.dtype == dtype else summed.astype(dtype)


def check_inputs(q: Any, k: Any, v: Any) -> None:
    """Shapes of this rank's q/k/v shards: rank 4, matching batch/length/heads, GQA."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != 4:
            raise ValueError(
                f"{name} must be rank 4 [batch, local_seq, heads, head_dim] (Paddle layout), "
                f"got shape {list(t.shape)}"
            )
    b, lq, hq, d = q.shape
    if list(k.shape[:2]) != [b, lq] or list(v.shape[:3]) != list(k.shape[:3]):
        raise ValueError(
            f"q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} must share batch and "
            "local sequence length (k and v also heads): pass this rank's shards of all three"
        )
    if k.shape[3] != d:
        raise ValueError(f"q head_dim {d} != k head_dim {k.shape[3]}")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[2]}) for GQA"
        )


def resolve_group(group: Any) -> Any:
    """The group CP attention runs on: `group` itself, or for None the world group.

    None follows `paddle.distributed`'s convention (its collectives read `group=None` as the
    default group of every rank): the whole job when `paddle.distributed` is initialised with
    more than one rank (after plain `paddle.distributed.init_parallel_env()` or flashcp's
    `init_distributed()`), and a single rank otherwise (returned as None). The world group is
    `flashcp.distributed.world_group()`: Paddle's default process group wrapped as a
    `NamedGroup` labelled `world[0,1,...]`, the same handle `build_groups(...).world` holds and
    the one a cp group spanning every rank reuses, so the all-gather, the ordered ring
    reduce-scatter on gloo, the watchdog and the byte counters work on it unchanged.
    """
    if group is not None:
        return group
    world = world_group()
    return None if world.is_trivial else world


def plan_cp_attention(
    q: Any,
    k: Any,
    startend_row_indices: Any,
    *,
    group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    mode: str = registry.DEFAULT_MODE,
    assignment: Assignment | None = None,
    fa4_unavailable: str | fa_dispatch.Policy | None = None,
) -> CPPlan:
    """Validate, pick the layout, rebase the mask and resolve the FA version — before compute.

    `group=None` means the world group (see `resolve_group`).
    """
    implicit = group is None
    group = resolve_group(group)
    world = 1 if group is None else int(group.nranks)
    rank = 0 if group is None else int(group.rank)
    if startend_row_indices is None:
        raise ValueError(
            "flashmask_attention_cp needs the global startend_row_indices (every rank keeps "
            "the whole [B, Hm, S, C] mask); for plain causal attention build one with "
            "flashcp.masks.causal_mask(batch, seq_len)"
        )
    idx = as_numpy(startend_row_indices)
    seq = int(q.shape[1]) * world
    if idx.ndim == 4 and idx.shape[2] != seq:
        hint = ""
        if implicit and world > 1:
            hint = (
                f"; group=None means the world group ({world} ranks, as in "
                "paddle.distributed): pass group= your cp group, or use "
                "flashcp.attention.flashmask.flashmask_attention for attention on this rank "
                "alone"
            )
        raise ValueError(
            f"startend_row_indices covers {idx.shape[2]} keys but the global sequence is "
            f"{seq} (local {q.shape[1]} × cp {world}): pass the GLOBAL mask on every rank"
            f"{hint}"
        )
    validate(
        idx,
        causal=causal,
        batch=int(q.shape[0]),
        q_len=seq,
        k_len=seq,
        num_q_heads=int(q.shape[2]),
        num_kv_heads=int(k.shape[2]),
    )
    if assignment is None:
        assignment = registry.make_assignment(mode, world, idx, causal=causal)
    else:
        registry.get(mode)  # an unknown mode fails even with an explicit layout
    if assignment.world != world:
        raise ValueError(f"assignment is for {assignment.world} ranks but the group has {world}")
    assignment.chunk_len(seq)  # raises, naming data.seq_len, if S doesn't split evenly
    local = rebase_mask(idx, causal=causal, assignment_or_positions=assignment, rank=rank)
    head_dim = int(q.shape[3])
    version = fa_dispatch.resolve_current(  # FA4's per-call limits see the rebased local mask
        head_dim, policy=fa4_unavailable, mask_shape=local.shape, num_kv_heads=int(k.shape[2])
    ).version
    device = device_of(q)
    return CPPlan(
        version=version,
        device=device,
        mask=paddle.to_tensor(np.ascontiguousarray(local), dtype="int32", place=q.place),
        causal=False,
        scale=resolve_scale(softmax_scale, head_dim),
        group=group,
        rank=rank,
        world=world,
        assignment=assignment,
    )


class AllGatherKV(AttentionImpl[CPPlan]):
    """All-gather K/V, one FlashMask call on the local queries, reduce-scatter dK/dV."""

    name = "allgather_kv"

    def plan(self, q: Any, k: Any, v: Any, ctx: AttentionContext) -> CPPlan:
        check_inputs(q, k, v)
        return plan_cp_attention(
            q,
            k,
            as_numpy(ctx.mask) if ctx.mask is not None else None,
            group=ctx.group,
            causal=ctx.causal,
            mode=ctx.mode,
            assignment=ctx.assignment,
            fa4_unavailable=ctx.fa4_unavailable,
        )

    def forward(self, q: Any, k: Any, v: Any, plan: CPPlan) -> tuple[Any, Any]:
        """Gather K/V and run the kernel of the planned version: local (out, lse)."""
        backend = get_backend(plan.version, plan.device)
        k_all, v_all = gather_kv(k, plan), gather_kv(v, plan)
        return backend.forward(q, k_all, v_all, plan.mask, causal=False, softmax_scale=plan.scale)

    def backward(
        self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, plan: CPPlan
    ) -> tuple[Any, Any, Any]:
        """Re-gather K/V, run the planned version's backward, reduce-scatter dK/dV to owners."""
        backend = get_backend(plan.version, plan.device)
        k_all, v_all = gather_kv(k, plan), gather_kv(v, plan)
        dq, dk_all, dv_all = backend.backward(
            q, k_all, v_all, out, lse, plan.mask, dout, causal=False, softmax_scale=plan.scale
        )
        return dq, scatter_grad(dk_all, plan), scatter_grad(dv_all, plan)


ALLGATHER_KV = AllGatherKV()
"""The one all-gather-KV implementation (stateless; the registry names it)."""


def flashmask_attention_cp(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    startend_row_indices: Any,
    *,
    group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    mode: str = registry.DEFAULT_MODE,
    assignment: Assignment | None = None,
    return_lse: bool = False,
    dropout: float = 0.0,
    fixed_seed_offset: Any = None,
    fa4_unavailable: str | fa_dispatch.Policy | None = None,
) -> Any:
    """Exact FlashMask attention of this rank's query shard against the whole sequence.

    q/k/v are this rank's local shards `[B, S/cp, H, D]` in the layout of `mode` (or of
    `assignment`); `startend_row_indices` is the GLOBAL mask `[B, Hm, S, C]` (O(S), every rank
    keeps it; any value >= S means "through the last row", as upstream FlashMask reads it).
    Returns the local output `[B, S/cp, Hq, Dv]` (and LSE `[B, Hq, S/cp]`).

    `group` is the CP group (a Paddle `Group`, e.g. `build_groups(...).cp`). As everywhere in
    `paddle.distributed`, `group=None` means the world group: every rank of the job when
    `paddle.distributed` is initialised with more than one rank (plain
    `paddle.distributed.init_parallel_env()` is enough), a single rank otherwise. For attention
    over this rank's data alone inside a multi-rank job, call
    `flashcp.attention.flashmask.flashmask_attention` (or pass a one-rank group).
    """
    if dropout:
        raise NotImplementedError(
            f"dropout={dropout}: attention dropout is not supported under context parallelism "
            "(set the attention dropout to 0)"
        )
    if fixed_seed_offset is not None:
        raise NotImplementedError(
            "fixed_seed_offset is not supported under context parallelism (no dropout RNG)"
        )
    check_inputs(q, k, v)
    plan = plan_cp_attention(
        q,
        k,
        startend_row_indices,
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        mode=mode,
        assignment=assignment,
        fa4_unavailable=fa4_unavailable,
    )
    out, lse = ALLGATHER_KV.apply_with_lse(q, k, v, plan)
    return (out, lse) if return_lse else out
