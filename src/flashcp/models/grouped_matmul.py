"""Grouped matmul: ``y_e = x_e @ w[e]`` for every expert `e` at once, no host sync per expert.

The routed experts' weights are stacked, `w` `[E, K, N]` (`flashcp.models.experts`); their
input rows come in an `ExpertLayout` (chosen per call from the host-known row counts):

* **groups** (CPU): the buffer is a sequence of groups; group `g` holds experts `experts[g]`
  (a few, or all, of them), each padded to the group's `capacity` rows, so a group is one
  batched matmul ``[n, C, K] @ [n, K, N]``. One group of all experts in index order is the
  plain padded layout; one group per expert (capacity = its count) is the ragged loop; sorting
  the experts by count and cutting them into a few groups keeps both the padding and the
  number of calls small (`plan_layout`). With the weights in the rows' dtype (float32
  training) the layout is one group per expert and `_ExpertMatmuls` multiplies each expert's
  rows by its own slice of the stack, writing every product in place into one output; the
  padded groups serve the cast path (`_GroupedMatmul`, bf16 storage).
* **ragged** (GPU): expert `e`'s rows contiguous, no padding, experts in index order — for
  Paddle's grouped GEMM, `paddle.incubate.nn.functional.batched_gemm`
  (``paddle/phi/kernels/legacy/gpu/batched_gemm.cu``: cuBLAS per expert inside one op, host
  batch sizes; `trans_lhs` computes the per-expert weight gradient). Paddle 3.3.1 registers it
  for GPU only (on CPU: "kernel batched_gemm is not registered") and binds no backward, so
  `_BatchedGemm` gives it one: ``dX = batched_gemm(dY, W, trans_rhs)``,
  ``dW = batched_gemm(X, dY, trans_lhs)``. PaddleFleet's MoE layer uses the same op for its
  grouped GEMM (PaddleFleet PR #370). It computes in the weights' dtype.

`_GroupedMatmul` takes each group's weights out of the stack without autograd (a slice for a
contiguous run of experts, else a gather), at most `CAST_CHUNK_BYTES` of them at a time, cast
to the activations' dtype — so with bf16 storage on CPU (no bf16 matmul kernel) no float32
copy of all experts ever exists, and only the stored weights are saved for backward (as
`flashcp.models.precision.cast_linear` does for one matrix) — and assembles one `[E, K, N]`
weight gradient. Every path is deterministic (no atomics, fixed summation order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer

from flashcp.models.expert_layout import CAST_CHUNK_BYTES, Group, contiguous


def _weights(
    w: paddle.Tensor, experts: Sequence[int], index: paddle.Tensor, dtype: Any
) -> paddle.Tensor:
    """`w[experts]` `[n, K, N]` in `dtype` (`index`: `experts` as a tensor): a slice when the
    run is contiguous, else a gather."""
    if contiguous(experts):
        part = w[experts[0] : experts[0] + len(experts)]
    else:
        part = paddle.gather(w, index, axis=0)
    return part if part.dtype == dtype else part.astype(dtype)


def _chunks(group: Group, w: paddle.Tensor, dtype: Any) -> list[Group]:
    """`group` cut into runs of experts whose `dtype` weights fit `CAST_CHUNK_BYTES`."""
    item = paddle.empty([0], dtype=dtype).element_size()
    per = max(1, CAST_CHUNK_BYTES // max(int(w.shape[1]) * int(w.shape[2]) * item, 1))
    out = []
    for a in range(0, len(group.experts), per):
        experts = group.experts[a : a + per]
        out.append(Group(experts, group.capacity, group.start + a * group.capacity))
    return out


def _expert_rows(groups: Sequence[Group]) -> list[tuple[int, int, int]]:
    """(expert, first buffer row, rows) of every expert of `groups`, in buffer order."""
    return [
        (e, g.start + i * g.capacity, g.capacity) for g in groups for i, e in enumerate(g.experts)
    ]


class _ExpertMatmuls(PyLayer):
    """The groups' rows expert by expert, one 2-D matmul each on the stacked weights' own
    slice: when no cast is needed (weights in the rows' dtype) nothing is copied out of the
    stack, and the transposes of the backward are GEMM flags (`scripts/bench/moe_step.py`: a
    2-D GEMM runs closer to the core's peak than a batched one with a transposed operand).
    Each product is written in place into its rows (or its expert's block) of one output
    (`paddle.matmul(out=)` on a slice view), so no concat or stack copies the results again:
    measured (cProfile of the GLM-4.5-Air / 8 step of `scripts/bench_moe_step.py`) the stacks
    of the `[128, 512, 352]` weight gradients alone took 0.19 s of a ~5 s step, and a matmul
    into a slice view costs what a fresh one does (`--compare padded_experts_concat_stack`)."""

    @staticmethod
    def forward(ctx, x, w, groups):  # type: ignore[no-untyped-def, override]
        ctx.rows = [r for r in _expert_rows(groups) if r[2] > 0]
        ctx.save_for_backward(x, w)
        return _row_products(x, w, ctx.rows, transpose_w=False)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        x, w = ctx.saved_tensor()
        dx = dw = None
        if not x.stop_gradient:
            dx = _row_products(dy, w, ctx.rows, transpose_w=True)
        if not w.stop_gradient:
            dw = paddle.empty(w.shape, dtype=w.dtype)
            for e, a, n in ctx.rows:
                paddle.matmul(x[a : a + n], dy[a : a + n], transpose_x=True, out=dw[e])
            for e in sorted(set(range(int(w.shape[0]))) - {e for e, _, _ in ctx.rows}):
                dw[e].zero_()  # an expert without rows: exactly zero
        return dx, dw


def _row_products(
    x: paddle.Tensor, w: paddle.Tensor, rows: Sequence[tuple[int, int, int]], *, transpose_w: bool
) -> paddle.Tensor:
    """`[R, N]`: rows `a .. a + n` of `x` times `w[e]` (transposed: `w[e]ᵀ`) for each
    `(e, a, n)` of `rows` (which cover all R rows: `grouped_matmul` checks), written in place."""
    n_out = int(w.shape[1] if transpose_w else w.shape[2])
    out = paddle.empty([int(x.shape[0]), n_out], dtype=x.dtype)
    for e, a, n in rows:
        paddle.matmul(x[a : a + n], w[e], transpose_y=transpose_w, out=out[a : a + n])
    return out


class _GroupedMatmul(PyLayer):
    """Every group's batched matmul (see the module docstring); saves `x` and `w` as given."""

    @staticmethod
    def forward(ctx, x, w, groups):  # type: ignore[no-untyped-def, override]
        chunks = [c for g in groups for c in _chunks(g, w, x.dtype)]
        ctx.chunks = [(c, paddle.to_tensor(list(c.experts), dtype="int64")) for c in chunks]
        ctx.save_for_backward(x, w)
        n_out = int(w.shape[2])
        parts = []
        for c, index in ctx.chunks:
            xs = x[c.start : c.start + c.rows].reshape([len(c.experts), c.capacity, -1])
            ys = paddle.bmm(xs, _weights(w, c.experts, index, x.dtype))
            parts.append(ys.reshape([c.rows, n_out]))
        if not parts:
            return paddle.zeros([int(x.shape[0]), n_out], dtype=x.dtype)
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        x, w = ctx.saved_tensor()
        dx_parts, dw_parts = [], []
        for c, index in ctx.chunks:
            n = len(c.experts)
            dys = dy[c.start : c.start + c.rows].reshape([n, c.capacity, -1])
            if not x.stop_gradient:
                wt = _weights(w, c.experts, index, dy.dtype)
                dx_parts.append(paddle.bmm(dys, wt.transpose([0, 2, 1])).reshape([c.rows, -1]))
            if not w.stop_gradient:
                xs = x[c.start : c.start + c.rows].reshape([n, c.capacity, -1])
                part = paddle.matmul(xs, dys, transpose_x=True).astype(w.dtype)
                dw_parts.append((c.experts, index, part))
        dx = None
        if not x.stop_gradient:
            dx = paddle.concat(dx_parts, axis=0) if dx_parts else paddle.zeros_like(x)
        dw = None if w.stop_gradient else _assemble(w, dw_parts)
        return dx, dw


def _assemble(w: paddle.Tensor, parts: list[tuple[tuple[int, ...], paddle.Tensor, Any]]) -> Any:
    """The `[E, K, N]` gradient from per-chunk parts (experts absent from every chunk: zeros),
    each expert block written once, in place into a zero tensor. CPU `scatter` has no bf16
    kernel, so 2-byte dtypes are scattered as bit copies through an int32 view (N even);
    otherwise the parts and zero blocks are concatenated and put in order by a gather."""
    dw = paddle.zeros(w.shape, dtype=w.dtype)
    if w.dtype in (paddle.float32, paddle.float64):
        for _, index, part in parts:
            dw.scatter_(index, part, overwrite=True)
        return dw
    if dw.element_size() == 2 and int(w.shape[-1]) % 2 == 0:
        bits = dw.view("int32")
        for _, index, part in parts:
            bits.scatter_(index, part.contiguous().view("int32"), overwrite=True)
        return dw
    held = [e for experts, _, _ in parts for e in experts]
    missing = sorted(set(range(int(w.shape[0]))) - set(held))
    blocks = [part for _, _, part in parts]
    if missing:
        blocks.append(paddle.zeros([len(missing), *w.shape[1:]], dtype=w.dtype))
    order = np.argsort(np.asarray(held + missing), kind="stable")
    stacked = blocks[0] if len(blocks) == 1 else paddle.concat(blocks, axis=0)
    return paddle.gather(stacked, paddle.to_tensor(order, dtype="int64"), axis=0)


def grouped_matmul(x: paddle.Tensor, w: paddle.Tensor, groups: Sequence[Group]) -> paddle.Tensor:
    """`x` `[R, K]` (rows laid out as `groups`) times each row's expert weight → `[R, N]` in
    `x.dtype`. Rows of no group (none, for a layout from `plan_layout`) give zeros."""
    covered = sum(g.rows for g in groups)
    if covered != int(x.shape[0]):
        raise ValueError(f"grouped_matmul: groups cover {covered} rows, x has {int(x.shape[0])}")
    if w.dtype == x.dtype:
        return _ExpertMatmuls.apply(x, w, list(groups))
    return _GroupedMatmul.apply(x, w, list(groups))


class _BatchedGemm(PyLayer):
    """Paddle's GPU grouped GEMM with the backward Paddle 3.3.1 does not bind."""

    @staticmethod
    def forward(ctx, x, w, counts):  # type: ignore[no-untyped-def, override]
        from paddle.incubate.nn.functional import batched_gemm

        ctx.counts = [int(c) for c in counts]
        ctx.save_for_backward(x, w)
        return batched_gemm(x, w, ctx.counts, False, False)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        from paddle.incubate.nn.functional import batched_gemm

        x, w = ctx.saved_tensor()
        dx = None if x.stop_gradient else batched_gemm(dy, w, ctx.counts, False, True)
        dw = None
        if not w.stop_gradient:
            dw = batched_gemm(x, dy, ctx.counts, True, False)
            # an expert without rows is a k = 0 product: make its gradient exactly zero
            empty = paddle.to_tensor(np.array(ctx.counts) == 0, place=dw.place)
            dw = paddle.where(empty.reshape([-1, 1, 1]), paddle.zeros_like(dw), dw)
        return dx, dw


def batched_gemm_matmul(x: paddle.Tensor, w: paddle.Tensor, counts: Sequence[int]) -> paddle.Tensor:
    """`x` `[M, K]` (expert `e`'s `counts[e]` rows contiguous, index order) times `w[e]` with
    Paddle's GPU grouped GEMM, in `w.dtype`; the result in `x.dtype`."""
    if len(counts) != int(w.shape[0]) or sum(int(c) for c in counts) != int(x.shape[0]):
        raise ValueError(
            f"batched_gemm_matmul: counts {list(counts)} do not describe {int(x.shape[0])} "
            f"rows of {int(w.shape[0])} experts"
        )
    return _BatchedGemm.apply(x.astype(w.dtype), w, list(counts)).astype(x.dtype)
