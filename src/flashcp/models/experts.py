"""The routed experts of one MoE layer, stacked, evaluated together on the expert-sorted buffer.

`GroupedExperts` holds the weights of experts ``first_expert .. first_expert + E - 1`` as two
stacked parameters in Paddle's `[in, out]` orientation, the layout of PaddleFormers'
``MoeExperts`` (so its ``LoRAMoeExperts`` adapts them, see `flashcp.lora.model`):

* ``gate_up_proj`` `[E, H, 2I]`: expert `e`'s ``gate_proj`` in columns `[0, I)`, ``up_proj``
  in `[I, 2I)` (HF keys ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj.weight``, `[I, H]`);
* ``down_proj`` `[E, I, H]` (HF ``mlp.experts.{e}.down_proj.weight``, `[H, I]`).

`flashcp.models.hf_state` maps the per-expert HF keys to these slices. Each expert's slice is
initialised from its own (seed, name, expert index) stream (`flashcp.models.init`), so a rank
holding a subset of the experts builds exactly its slices of the whole tensors.

`forward(x, layout)` computes ``down(silu(gate) · up)`` of every row of `x` with its expert's
weights, the rows laid out as `layout` (an `ExpertLayout`, from `plan_layout` over the
host-known per-expert row counts):

* on GPU, **ragged**: expert `e`'s rows contiguous in index order, Paddle's grouped GEMM;
* on CPU with weights stored in the rows' dtype (float32 training), **one group per expert**:
  one 2-D matmul per expert on the stack's own slice, written in place (no padding, no copies
  of the weights or the products; `flashcp.models.grouped_matmul`);
* on CPU with a cast (bf16-stored weights), **groups**: the experts sorted by row count
  (largest first) and cut into `G` groups of consecutive experts, each padded to its largest
  count, one batched matmul per group on upcast weights. `G` minimises
  ``padded rows + G · GROUP_COST_ROWS`` over G = 1, 2, 4, ..., E: one group for an even load
  (one bmm, a little padding), more when the load is skewed (a hot expert would otherwise pad
  every expert to its count). Measured here (`scripts/bench_moe.py`): faster than both one
  padded bmm and the per-expert loop.

Row dtype (`GroupedExperts.row_dtype`): Paddle's grouped GEMM computes in the weights' dtype,
so with bf16-stored weights on a GPU the MoE layer casts its rows to bf16 BEFORE dispatching
them (`flashcp.models.moe.MoE`): the expert buffers, the all-to-all traffic of expert
parallelism and the expert outputs sent back are half the bytes of float32 rows, and the result
is the same — the GEMM rounded its inputs to bf16 anyway, and its bf16 outputs are widened
exactly where float32 is needed (the SwiGLU, as before; the combine). On CPU (batched matmuls
on upcast weights) and for float32 weights the rows keep the activations' dtype.

Padding rows hold zeros (zero output, zero weight gradient); they never reach a token
(`flashcp.models.moe_dispatch.relayout`). `ExpertLayout.enter` / `leave` move a ragged
buffer (`moe_dispatch.permute` without relayout, e.g. rows received from other ranks) into
and out of a layout. Every layout gives the same result up to float32 rounding (~1e-7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from flashcp.models.expert_layout import Group, cost_chosen_groups, cpu_groups, layout_groups
from flashcp.models.grouped_matmul import batched_gemm_matmul, grouped_matmul
from flashcp.models.init import normal_attr
from flashcp.models.precision import as_dtype

LAYOUTS = ("auto", "padded", "ragged", "grouped")
"""`GroupedExperts.layout`: auto (per device), or forced (tests, the benchmark): one padded
group, one group per expert (the ragged loop), or the cost-chosen groups."""


@dataclass(frozen=True)
class ExpertLayout:
    """The buffer the experts compute on (see the module docstring)."""

    counts: tuple[int, ...]
    """Rows per expert (index order)."""
    groups: tuple[Group, ...] | None
    """The padded groups; None: ragged (expert order, no padding; Paddle's grouped GEMM)."""

    @property
    def rows(self) -> int:
        """Rows of the laid-out buffer (padding included)."""
        if self.groups is None:
            return int(sum(self.counts))
        return sum(g.rows for g in self.groups)

    def is_ragged_order(self) -> bool:
        """Whether the groups lay the rows out as the ragged buffer does: one group per
        expert, experts in index order, no padding."""
        if self.groups is None:
            return True
        held = [e for g in self.groups for e in g.experts]
        return (
            all(len(g.experts) == 1 for g in self.groups)
            and held == sorted(held)
            and self.rows == int(sum(self.counts))
        )

    def row_index(self) -> paddle.Tensor | None:
        """`[M]` int64: the laid-out row of each ragged row (expert order); None if ragged or
        the groups are the ragged buffer itself (one per expert, index order, no padding)."""
        if self.groups is None or self.is_ragged_order():
            return None
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        index = np.zeros(int(sum(self.counts)), dtype=np.int64)
        for g in self.groups:
            for i, e in enumerate(g.experts):
                n = self.counts[e]
                index[starts[e] : starts[e] + n] = g.start + i * g.capacity + np.arange(n)
        return paddle.to_tensor(index)

    def rows_of(self, order: np.ndarray | None = None) -> paddle.Tensor | None:
        """`[M]` int64: the laid-out row of each row of a ragged buffer whose row `i` is the
        expert-order ragged row `order[i]` (None: the buffer is in expert order); None when
        that buffer already is the layout."""
        index = self.row_index()
        if order is None:
            return index
        order = np.asarray(order, dtype=np.int64)
        if index is None and np.array_equal(order, np.arange(order.shape[0])):
            return None  # already in expert order (e.g. one source rank): nothing to move
        if index is None:
            return paddle.to_tensor(order)
        return paddle.gather(index, paddle.to_tensor(order))

    def enter(self, x: paddle.Tensor, order: np.ndarray | None = None) -> paddle.Tensor:
        """A ragged buffer `[M, H]` laid out: `[rows, H]`, zero padding. Its rows are in expert
        order, or (`order` given, e.g. rows received from other ranks, source-major) row `i` is
        the expert-order row `order[i]` (a permutation of `range(M)`)."""
        index = self.rows_of(order)
        return x if index is None else _ScatterRows.apply(x, index, self.rows)

    def leave(self, y: paddle.Tensor, order: np.ndarray | None = None) -> paddle.Tensor:
        """Laid-out rows back to the ragged buffer's `[M, N]` (in the row order `enter` took)."""
        index = self.rows_of(order)
        return y if index is None else _GatherRows.apply(y, index)

    def matmul(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        """Laid-out rows `x` `[rows, K]` times their experts' `w[e]` → `[rows, N]`."""
        if self.groups is None:
            return batched_gemm_matmul(x, w, self.counts)
        return grouped_matmul(x, w, self.groups)


def on_grouped_gemm(x: paddle.Tensor) -> bool:
    """Whether rows like `x` go through Paddle's grouped GEMM (on a GPU) rather than the
    batched matmuls of the CPU groups (tests substitute a fake GEMM on CPU through this)."""
    return bool(x.place.is_gpu_place())


def plan_layout(
    counts: Sequence[int], x: paddle.Tensor, mode: str = "auto", weight_dtype: Any = None
) -> ExpertLayout:
    """The layout of one call (module docstring): `mode` auto — ragged on GPU; on CPU one group
    per expert when the weights (`weight_dtype`, default `x`'s) are in the rows' dtype, else
    cost-chosen groups (`expert_layout.cpu_groups`) — or forced: "padded" (one group, index
    order), "ragged" (one group per expert on CPU; Paddle's grouped GEMM on GPU), "grouped"
    (cost-chosen groups)."""
    if mode not in LAYOUTS:
        raise ValueError(f"expert layout {mode!r}: use one of {LAYOUTS}")
    counts = tuple(int(c) for c in counts)
    experts = len(counts)
    if mode == "auto" and on_grouped_gemm(x):
        mode = "ragged"
    if mode == "ragged" and on_grouped_gemm(x):
        return ExpertLayout(counts, None)
    if mode == "auto":
        same = weight_dtype is None or weight_dtype == x.dtype
        return ExpertLayout(counts, cpu_groups(counts, per_expert=same))
    if mode == "padded":
        return ExpertLayout(counts, layout_groups(counts, range(experts), experts))
    if mode == "ragged":
        return ExpertLayout(counts, layout_groups(counts, range(experts), 1))
    return ExpertLayout(counts, cost_chosen_groups(counts))


class _GatherRows(PyLayer):
    """`x[index]` with unique `index`; backward writes each row's gradient back (no adds)."""

    @staticmethod
    def forward(ctx, x, index):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(index)
        ctx.rows = int(x.shape[0])
        return paddle.gather(x, index, axis=0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (index,) = ctx.saved_tensor()
        full = paddle.zeros([ctx.rows, int(grad.shape[-1])], dtype=grad.dtype)
        return paddle.scatter(full, index, grad, overwrite=True), None


class _ScatterRows(PyLayer):
    """Rows of `x` placed at unique `index` of a zero `[rows, N]` tensor; backward gathers."""

    @staticmethod
    def forward(ctx, x, index, rows):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(index)
        full = paddle.zeros([rows, int(x.shape[-1])], dtype=x.dtype)
        return paddle.scatter(full, index, x, overwrite=True)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (index,) = ctx.saved_tensor()
        return paddle.gather(grad, index, axis=0), None


class GroupedExperts(nn.Layer):
    """Experts ``first_expert .. first_expert + num_experts - 1`` of one MoE layer's
    `total_experts` (module doc; a subset under expert parallelism).

    `layout` ("auto", or a forced one of `LAYOUTS`) is what `plan` uses.
    """

    STACKED_EXPERTS = True
    """Marks a stacked-experts layer for `flashcp.models.hf_state` (per-expert HF keys)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        std: float,
        first_expert: int = 0,
        total_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.first_expert = first_expert
        self.total_experts = num_experts if total_experts is None else int(total_experts)
        """The layer's routed experts in all (more than `num_experts` under expert parallelism:
        `flashcp.models.expert_parallel`)."""
        self.act_fn = F.silu  # read by PaddleFormers' LoRAMoeExperts
        self.layout = "auto"
        attr = normal_attr(std, keyed_rows=True, first_row=first_expert)
        self.gate_up_proj = self.create_parameter(
            [num_experts, hidden_size, 2 * intermediate_size], attr=attr
        )
        attr = normal_attr(std, keyed_rows=True, first_row=first_expert)
        self.down_proj = self.create_parameter(
            [num_experts, intermediate_size, hidden_size], attr=attr
        )

    def plan(self, counts: Sequence[int], x: paddle.Tensor) -> ExpertLayout:
        """The layout for rows `counts` per expert (`plan_layout` under `self.layout`)."""
        if len(counts) != self.num_experts:
            raise ValueError(f"{len(counts)} row counts for {self.num_experts} experts")
        return plan_layout(counts, x, self.layout, self.gate_up_proj.dtype)

    def row_dtype(self, x: paddle.Tensor) -> paddle.dtype:
        """The dtype the MoE layer sends rows of activations `x` to these experts in: the
        weights' on Paddle's grouped GEMM (it computes in them), else `x`'s (module doc)."""
        ragged = self.layout in ("auto", "ragged") and on_grouped_gemm(x)
        return self.gate_up_proj.dtype if ragged else x.dtype

    def project(self, name: str, x: paddle.Tensor, layout: ExpertLayout) -> paddle.Tensor:
        """Laid-out rows `x` times the stacked weight `name` (adapters add theirs), in
        `x.dtype`."""
        return layout.matmul(x, getattr(self, name))

    def forward(self, x: paddle.Tensor, layout: ExpertLayout) -> paddle.Tensor:
        """``down(silu(gate) · up)`` of every row of `x` `[layout.rows, H]` → `[rows, H]` in
        `x.dtype`. The SwiGLU runs in float32 whatever the rows' dtype (a bf16 GEMM output
        widens exactly), and its output is rounded to the rows' dtype for the down GEMM, which
        would round it so itself: bf16 rows compute what float32 rows do (`row_dtype`)."""
        gate_up = self.project("gate_up_proj", x, layout)
        if gate_up.element_size() < 4:
            gate_up = gate_up.astype("float32")
        # silu(gate) · up, gate the first half of the fused projection, in one kernel
        act = F.swiglu(gate_up)
        del gate_up  # without gradients it dies before the down GEMM (with them swiglu keeps it)
        return self.project("down_proj", as_dtype(act, x.dtype), layout)
