"""The experts' row layouts as host arithmetic, without Paddle: the groups a CPU grouped matmul runs
(`Group`, `cpu_groups`: one per expert, or `cost_chosen_groups`), the weights taken out of the stack
at once (`CAST_CHUNK_BYTES`) and the rows per expert of a capacity factor (`capacity_for`) — one
definition that the model (`flashcp.models.experts`, `grouped_matmul`, `moe_dispatch`) computes with
and the memory planner (`flashcp.plan.moe_rows`) evaluates on expected counts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CAST_CHUNK_BYTES = 64 * 2**20
"""Weights taken out of the stack (and upcast) at once, in bytes of the compute dtype."""
GROUP_COST_ROWS = 64
"""The cost of one more group (its calls), in padded rows (`plan_layout`)."""


@dataclass(frozen=True)
class Group:
    """Experts `experts` (global stack indices), each padded to `capacity` rows, starting at
    buffer row `start`: rows ``start + i·capacity + r`` belong to ``experts[i]``."""

    experts: tuple[int, ...]
    capacity: int
    start: int

    @property
    def rows(self) -> int:
        return len(self.experts) * self.capacity


def contiguous(experts: Sequence[int]) -> bool:
    """Whether `experts` is a run of consecutive stack indices (its weights are one slice)."""
    return list(experts) == list(range(experts[0], experts[0] + len(experts)))


def layout_groups(counts: Sequence[int], order: Sequence[int], size: int) -> tuple[Group, ...]:
    """Consecutive runs of `size` experts of `order`, each padded to its largest count; an
    expert without rows is left out (empty runs too)."""
    out, start = [], 0
    for a in range(0, len(order), size):
        experts = tuple(int(e) for e in order[a : a + size] if counts[e] > 0)
        if not experts:
            continue
        capacity = max(counts[e] for e in experts)
        out.append(Group(experts, capacity, start))
        start += len(experts) * capacity
    return tuple(out)


def cost_chosen_groups(counts: Sequence[int]) -> tuple[Group, ...]:
    """The CPU "grouped" layout of rows `counts` per expert (module docstring): the experts
    sorted by count, largest first, cut into runs of E, E/2, ..., 1 experts; the cut with the
    fewest ``padded rows + GROUP_COST_ROWS · groups``. Pure (host ints), so the memory planner
    (`flashcp.plan.moe_rows`) evaluates it on expected counts."""
    counts = tuple(int(c) for c in counts)
    order = np.argsort(-np.asarray(counts), kind="stable")  # largest first
    best: tuple[Group, ...] = ()
    best_cost = None
    size = len(counts)
    while size >= 1:
        groups = layout_groups(counts, order, size)
        cost = sum(g.rows for g in groups) + GROUP_COST_ROWS * len(groups)
        if best_cost is None or cost < best_cost:
            best, best_cost = groups, cost
        if size == 1:
            break
        size = max(1, size // 2)
    return best


def cpu_groups(counts: Sequence[int], *, per_expert: bool) -> tuple[Group, ...]:
    """The CPU layout of rows `counts` per expert: with `per_expert` (weights stored in the rows'
    dtype: one 2-D matmul per expert on the stack's own slice, `grouped_matmul._ExpertMatmuls`)
    one group per expert, no padding — a padded row would only add work, the calls are one per
    expert anyway; else (weights cast out of the stack, one batched matmul per group) the
    cost-chosen padded groups."""
    if per_expert:
        return layout_groups(counts, range(len(counts)), 1)
    return cost_chosen_groups(counts)


def capacity_for(factor: float, tokens: int, top_k: int, num_experts: int) -> int | None:
    """Rows per expert for `model.moe_capacity_factor` `factor` (0: dropless → None):
    ``ceil(factor · tokens · k / E)``, at least 1."""
    if factor <= 0:
        return None
    return max(1, math.ceil(factor * tokens * top_k / num_experts))
