"""Token dispatch for routed experts: sort the (token, choice) entries by expert once, and undo it.

The router picks `k` experts per token (`ids` `[T, k]`). The three steps of an MoE layer:

1. `build_dispatch(ids, E, capacity)` → `Dispatch`: a stable sort of the `T·k` entries by
   expert (so within an expert, entries keep token order), the per-expert row counts of the
   expert-sorted buffer, and for every entry its row in that buffer (`slot`). Everything is
   computed on the device; the counts reach the host once per call (`Dispatch.counts`, needed
   for buffer shapes), never once per expert.
2. `permute(x, d, dtype)` → the buffer `[M, H]`: row `r` holds token `d.entry[r] // k`,
   expert `e`'s rows contiguous (`d.counts[e]` of them, experts in index order) — what
   `flashcp.models.experts.GroupedExperts` evaluates, in the dtype it computes in (bf16 for
   bf16 weights on Paddle's grouped GEMM: cast once, before dispatch).
3. `combine(y, d, weights)` → `[T, H]` float32: ``out[t] = Σ_j weights[t, j] · y[slot[t, j]]``,
   summed over `j` in order, in float32 (as HF's Glm4Moe accumulates) on every device: its
   matmuls run under `flashcp.models.precision.float32_math` (a PyLayer's forward runs under
   the caller's bf16 autocast, which would cast them to bf16; TF32 off on GPU).

`relayout(d, row_index, rows)` moves the buffer's rows to other positions of a larger buffer
(the experts' padded groups, `flashcp.models.experts.ExpertLayout.row_index`): `permute` then
writes the tokens straight into that layout, zero rows between, and `combine` reads from it.

Expert parallelism inserts its all-to-all exchanges between 1/2 (send each expert's rows to
the rank holding it; the buffer is already grouped by expert, hence by destination rank) and
between the experts and 3 (send them back, same order), without changing these pieces.

Capacity (`model.moe_capacity_factor` > 0): at most `capacity` rows per expert; an entry past
its expert's capacity (the later tokens, in token order) is dropped — it has no buffer row,
`Dispatch.keep` is 0 for it, so it contributes nothing and gets no gradient — and counted in
`Dispatch.dropped`. Dropless (capacity None) keeps every entry: the default.

Both data movements are PyLayers whose forward and backward passes are gathers and fixed-order
sums (the permute backward sums each token's `k` buffer rows; the combine backward gives each
buffer row its own entry's gradient), so the results are deterministic on every device, with
no atomic scatter-add. On CPU float32 (`flashcp.models.cpu_elementwise.applies`) their bodies
run in numpy on the tensors' own buffers, outputs Paddle-allocated (the same domain and pattern
as `cpu_elementwise`): at the MoE step's shapes (`scripts/bench_moe_step.py`, 2048 tokens, top-8,
H=512) the permute's forward + backward take 19 ms instead of Paddle's gathers' and sum's 31 ms,
the combine's 27 instead of 36 (`--compare paddle_permute_combine` undoes it). The numpy sums
visit `j = 0..k-1` in order, in blocks of tokens that stay in cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
from paddle.autograd import PyLayer

from flashcp.kernels.numpy_bridge import empty
from flashcp.models.cpu_elementwise import applies, read_view
from flashcp.models.precision import float32_math


@dataclass
class Dispatch:
    """Where each (token, choice) entry of one MoE call goes (see the module docstring)."""

    num_tokens: int
    top_k: int
    slot: paddle.Tensor
    """`[T·k]` int64: buffer row of entry `t·k + j` (any row for a dropped entry: see `keep`)."""
    entry: paddle.Tensor
    """`[rows]` int64: the entry `t·k + j` each buffer row holds (its token is `entry // k`);
    `T·k` for a padding row (`relayout`)."""
    counts: list[int]
    """Rows per expert (after capacity), host ints; in the expert-sorted buffer expert `e`
    holds rows `[sum(counts[:e]), sum(counts[:e + 1]))`."""
    routed: np.ndarray
    """`[E]` int64: entries the router sent to each expert (before capacity): the load."""
    keep: paddle.Tensor | None = None
    """`[T, k]` float32, 1 for kept and 0 for dropped entries; None when nothing was dropped."""
    rows: int = -1
    """Rows of the buffer: `sum(counts)`, more after `relayout` (padding rows)."""

    def __post_init__(self) -> None:
        if self.rows < 0:
            self.rows = int(sum(self.counts))

    @property
    def padded(self) -> bool:
        """Whether the buffer has padding rows (no token; zero input, ignored output)."""
        return self.rows > int(sum(self.counts))

    @property
    def dropped(self) -> int:
        """Entries dropped by the capacity (0 when dropless)."""
        return int(self.routed.sum()) - int(sum(self.counts))


def build_dispatch(ids: paddle.Tensor, num_experts: int, capacity: int | None = None) -> Dispatch:
    """The dispatch of `ids` `[T, k]` (expert of each choice) over `num_experts` experts, into
    the expert-sorted buffer."""
    num_tokens, top_k = int(ids.shape[0]), int(ids.shape[1])
    flat = ids.reshape([-1]).astype("int64")
    entries = num_tokens * top_k
    order = paddle.argsort(flat, stable=True)  # the entry at each expert-sorted position
    routed = paddle.bincount(flat, minlength=num_experts).numpy().astype(np.int64)  # 1 sync
    if routed.shape[0] != num_experts:
        raise ValueError(f"expert ids outside [0, {num_experts}): counts {routed.tolist()}")
    positions = paddle.arange(entries, dtype="int64")
    if capacity is None or int(routed.max(initial=0)) <= capacity:
        slot = paddle.scatter(paddle.zeros([entries], dtype="int64"), order, positions)
        return Dispatch(num_tokens, top_k, slot, order, [int(c) for c in routed], routed)
    counts = np.minimum(routed, capacity)
    starts_routed = np.concatenate([[0], np.cumsum(routed)[:-1]]).astype(np.int64)
    starts_kept = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    expert = flat[order]  # expert of each sorted position
    rank = positions - paddle.to_tensor(starts_routed)[expert]  # position within its expert
    kept = rank < capacity
    row = paddle.where(kept, paddle.to_tensor(starts_kept)[expert] + rank, paddle.zeros_like(rank))
    slot = paddle.scatter(paddle.zeros([entries], dtype="int64"), order, row)
    keep = paddle.scatter(paddle.zeros([entries], dtype="float32"), order, kept.astype("float32"))
    entry = paddle.masked_select(order, kept)
    return Dispatch(
        num_tokens,
        top_k,
        slot,
        entry,
        [int(c) for c in counts],
        routed,
        keep.reshape([num_tokens, top_k]),
    )


def relayout(d: Dispatch, row_index: paddle.Tensor | None, rows: int) -> Dispatch:
    """`d` over another buffer of `rows` rows, in which the expert-sorted buffer's row `r`
    sits at `row_index[r]` (unique); the other rows are padding. None: `d` itself."""
    if row_index is None:
        return d
    entries = d.num_tokens * d.top_k
    slot = paddle.gather(row_index, d.slot)
    entry = paddle.scatter(paddle.full([rows], entries, dtype="int64"), row_index, d.entry)
    return Dispatch(d.num_tokens, d.top_k, slot, entry, d.counts, d.routed, d.keep, rows)


def _with_zero_row(x: paddle.Tensor) -> paddle.Tensor:
    return paddle.concat([x, paddle.zeros([1, int(x.shape[-1])], dtype=x.dtype)], axis=0)


def _per_token(rows: paddle.Tensor, slot: paddle.Tensor, tokens: int, top_k: int) -> paddle.Tensor:
    """`[T, k, N]`: the buffer row of every entry (any row for dropped ones: mask them)."""
    return paddle.gather(rows, slot, axis=0).reshape([tokens, top_k, int(rows.shape[-1])])


# -- the numpy bodies (CPU float32) ---------------------------------------------------------------

_BLOCK = 256
"""Tokens (or rows) per block of the numpy bodies: a block's `[256, H]` operands stay in cache
between the gather and the arithmetic on it."""


def _token_rows(
    x: np.ndarray, entry: np.ndarray, top_k: int, padded: bool, scale: np.ndarray | None = None
) -> paddle.Tensor:
    """`[rows, H]`: row `r` is token `entry[r] // k` of `x` `[T, H]`, times `scale[entry[r]]`
    if given; zero for padding rows (entry `T·k`)."""
    out, o = empty((entry.shape[0], x.shape[1]), x.dtype)
    token = entry // top_k
    for a in range(0, entry.shape[0], _BLOCK):
        b = min(a + _BLOCK, entry.shape[0])
        np.take(x, token[a:b], axis=0, out=o[a:b], mode="clip")  # padding rows: zeroed below
        if scale is not None:
            o[a:b] *= np.take(scale, entry[a:b], mode="clip")[:, None]
    if padded:
        o[token >= x.shape[0]] = 0
    return out


def _entry_sums(
    rows: np.ndarray, slot: np.ndarray, coef: np.ndarray | None, tokens: int, top_k: int
) -> paddle.Tensor:
    """`[T, H]`: ``Σ_j coef[t, j] · rows[slot[t, j]]`` (coef None: 1), summed in order
    `j = 0..k-1` in `rows`' dtype."""
    out, o = empty((tokens, rows.shape[1]), rows.dtype)
    slots = slot.reshape(tokens, top_k)
    part = np.empty((min(_BLOCK, tokens), rows.shape[1]), rows.dtype)
    for a in range(0, tokens, _BLOCK):
        b = min(a + _BLOCK, tokens)
        acc, tmp = o[a:b], part[: b - a]
        for j in range(top_k):
            dst = acc if j == 0 else tmp
            np.take(rows, slots[a:b, j], axis=0, out=dst, mode="clip")
            if coef is not None:
                dst *= coef[a:b, j : j + 1]
            if j:
                acc += tmp
    return out


def _entry_dots(
    rows: np.ndarray, slot: np.ndarray, grad: np.ndarray, keep: np.ndarray | None, top_k: int
) -> paddle.Tensor:
    """`[T, k]`: ``rows[slot[t, j]] · grad[t]`` (times `keep[t, j]`: 0 for dropped entries)."""
    tokens = grad.shape[0]
    out, o = empty((tokens, top_k), grad.dtype)
    slots = slot.reshape(tokens, top_k)
    part = np.empty((min(_BLOCK, tokens), rows.shape[1]), rows.dtype)
    for a in range(0, tokens, _BLOCK):
        b = min(a + _BLOCK, tokens)
        tmp = part[: b - a]
        for j in range(top_k):
            np.take(rows, slots[a:b, j], axis=0, out=tmp, mode="clip")
            np.einsum("th,th->t", tmp, grad[a:b], out=o[a:b, j])
    if keep is not None:
        o *= keep
    return out


class _Permute(PyLayer):
    """`x[token of each row]` (zeros for padding rows), in `dtype` (None: x's); backward sums
    each token's k row gradients in x's dtype (a gather and a fixed-order sum)."""

    @staticmethod
    def forward(ctx, x, entry, slot, keep, top_k, padded, dtype):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(slot, keep)
        ctx.top_k = top_k
        ctx.tokens = int(x.shape[0])
        ctx.x_dtype = x.dtype
        if applies(x) and dtype in (None, x.dtype):
            return _token_rows(read_view(x), read_view(entry), top_k, padded)
        src = x if dtype is None or dtype == x.dtype else x.astype(dtype)
        return paddle.gather(_with_zero_row(src) if padded else src, entry // top_k, axis=0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        slot, keep = ctx.saved_tensor()
        none = (None, None) + ((None,) if keep is not None else ())
        if applies(grad) and grad.dtype == ctx.x_dtype:
            k = None if keep is None else read_view(keep)
            return (_entry_sums(read_view(grad), read_view(slot), k, ctx.tokens, ctx.top_k),) + none
        if grad.dtype != ctx.x_dtype:  # rows sent in a narrower dtype: sum in x's
            grad = grad.astype(ctx.x_dtype)
        per_entry = _per_token(grad, slot, ctx.tokens, ctx.top_k)
        if keep is None:
            dx = per_entry.sum(axis=1)
        else:
            with float32_math():  # a 0/1 selection: exact only without TF32's rounding
                dx = paddle.matmul(keep.astype(grad.dtype).unsqueeze(1), per_entry).squeeze(1)
        return (dx,) + none


def permute(x: paddle.Tensor, d: Dispatch, dtype: paddle.dtype | None = None) -> paddle.Tensor:
    """The buffer `[d.rows, H]` of tokens `x` `[T, H]` (step 2), in `dtype` (default x's; the
    experts' row dtype, `flashcp.models.experts.GroupedExperts.row_dtype`: the tokens are cast
    once, before they are gathered and sent). Its gradient returns in x's dtype, each token's
    k rows summed in it."""
    if int(x.shape[0]) != d.num_tokens:
        raise ValueError(f"permute: {int(x.shape[0])} tokens, the dispatch has {d.num_tokens}")
    return _Permute.apply(x, d.entry, d.slot, d.keep, d.top_k, d.padded, dtype)


class _Combine(PyLayer):
    """``out[t] = Σ_j w[t, j] · y[slot[t, j]]`` in float32 (dropped entries weigh 0)."""

    @staticmethod
    def forward(ctx, y, weights, slot, entry, keep, top_k, padded):  # type: ignore[no-untyped-def, override]
        tokens = int(weights.shape[0])
        on_numpy = applies(y, weights)
        if on_numpy:
            w = weights
            if keep is not None:
                w, wn = empty((tokens, top_k), np.float32)
                np.multiply(read_view(weights), read_view(keep), out=wn)
        else:
            w = weights.astype("float32")
            if keep is not None:
                w = w * keep
        ctx.save_for_backward(y, w, slot, entry, keep)
        ctx.shape = (tokens, top_k)
        ctx.padded = padded
        ctx.weights_frozen = weights.stop_gradient
        ctx.weights_dtype = weights.dtype
        ctx.on_numpy = on_numpy
        if on_numpy:
            return _entry_sums(read_view(y), read_view(slot), read_view(w), tokens, top_k)
        rows = _per_token(y.astype("float32"), slot, tokens, top_k)
        with float32_math():  # float32 under the caller's bf16 autocast, TF32 off on GPU
            return paddle.matmul(w.unsqueeze(1), rows).squeeze(1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        y, w, slot, entry, keep = ctx.saved_tensor()
        tokens, top_k = ctx.shape
        none = (None, None) + ((None,) if keep is not None else ())
        if ctx.on_numpy and applies(grad):
            g, yn = read_view(grad), read_view(y)
            dy = None
            if not y.stop_gradient:
                dy = _token_rows(g, read_view(entry), top_k, ctx.padded, read_view(w).reshape(-1))
            dw = None
            if not ctx.weights_frozen:
                kn = None if keep is None else read_view(keep)
                dw = _entry_dots(yn, read_view(slot), g, kn, top_k)
            return (dy, dw) + none
        grad = grad.astype("float32")
        dy = None
        if not y.stop_gradient:  # row r's gradient: its weight times its token's gradient
            flat_w = w.reshape([-1, 1])
            if ctx.padded:  # padding rows: weight 0, the zero token
                flat_w, grad_rows = _with_zero_row(flat_w), _with_zero_row(grad)
            else:
                grad_rows = grad
            row_weight = paddle.gather(flat_w, entry, axis=0)
            dy = (paddle.gather(grad_rows, entry // top_k, axis=0) * row_weight).astype(y.dtype)
        dw = None
        if not ctx.weights_frozen:
            rows = _per_token(y.astype("float32"), slot, tokens, top_k)
            with float32_math():
                dw = paddle.matmul(rows, grad.unsqueeze(-1)).squeeze(-1)
            if keep is not None:
                dw = dw * keep
            dw = dw.astype(ctx.weights_dtype)
        return (dy, dw) + none


def combine(y: paddle.Tensor, d: Dispatch, weights: paddle.Tensor) -> paddle.Tensor:
    """Each token's weighted sum of its experts' outputs `y` `[d.rows, H]` → `[T, H]` float32."""
    if int(y.shape[0]) != d.rows:
        raise ValueError(f"combine: {int(y.shape[0])} expert rows, the dispatch has {d.rows}")
    return _Combine.apply(y, weights, d.slot, d.entry, d.keep, d.top_k, d.padded)
