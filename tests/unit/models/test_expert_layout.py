"""`flashcp.models.expert_layout`: the experts' row-layout arithmetic (no Paddle), pinned on
hand-worked cases — the model computes with it and the planner evaluates it."""

from __future__ import annotations

from flashcp.models.expert_layout import (
    GROUP_COST_ROWS,
    Group,
    capacity_for,
    contiguous,
    cost_chosen_groups,
    layout_groups,
)


def test_capacity_for_rounds_up_and_is_at_least_one_row() -> None:
    assert capacity_for(0.0, 32, 4, 16) is None  # dropless
    assert capacity_for(0.75, 32, 4, 16) == 6  # ceil(0.75 * 32 * 4 / 16) = 6
    assert capacity_for(1.0, 3, 1, 16) == 1  # ceil(3 / 16) = 1
    assert capacity_for(0.01, 1, 1, 64) == 1  # never 0 rows


def test_contiguous_runs_of_stack_indices() -> None:
    assert contiguous([3]) and contiguous([2, 3, 4])
    assert not contiguous([2, 4]) and not contiguous([4, 3]) and not contiguous([1, 2, 4])
    assert not contiguous([5, 6, 8])  # starts right, ends wrong


def test_even_load_is_one_group_in_count_order_ties_stable() -> None:
    """Equal counts: one group of all experts (least padding + fewest calls), in index order
    (a stable sort of the ties)."""
    assert cost_chosen_groups([4, 4, 4, 4]) == (Group((0, 1, 2, 3), 4, 0),)


def test_a_hot_expert_gets_its_own_group_largest_first() -> None:
    """One expert with 1000 rows, seven with 10: one group pads 8 × 1000 rows; groups of 4,
    2 and 1 cut that; groups of one expert each cost 1070 + 8 · GROUP_COST_ROWS — the cut of
    1 wins only when it is cheapest. The hot expert (index 5) comes first."""
    counts = [10, 10, 10, 10, 10, 1000, 10, 10]
    groups = cost_chosen_groups(counts)
    assert groups[0].experts[0] == 5 and groups[0].capacity == 1000
    cost = sum(g.rows for g in groups) + GROUP_COST_ROWS * len(groups)
    for size in (8, 4, 2, 1):
        order = sorted(range(8), key=lambda e: -counts[e])
        other = layout_groups(counts, order, size)
        assert cost <= sum(g.rows for g in other) + GROUP_COST_ROWS * len(other)
    assert groups == layout_groups(counts, [5, 0, 1, 2, 3, 4, 6, 7], 1)


def test_single_expert_cuts_are_considered_and_ties_keep_the_first() -> None:
    """Two experts, 1 and 500 rows: one group pads to 1000 rows (+64), two groups 501 (+128);
    the cut of one expert each (size 1, the last considered) wins. Equal costs keep the larger
    group (the first considered)."""
    assert cost_chosen_groups([1, 500]) == (Group((1,), 500, 0), Group((0,), 1, 500))
    # [64, 0]: one group = 64 rows + 64; the empty expert is left out either way, so the
    # two cuts are equal and the first (size 2) is kept
    assert cost_chosen_groups([64, 0]) == (Group((0,), 64, 0),)
    assert cost_chosen_groups([]) == ()
    # [74, 10]: one group 148 rows + 64 = two groups 84 rows + 128 = 212: the one group stays
    assert cost_chosen_groups([74, 10]) == (Group((0, 1), 74, 0),)


def test_halving_visits_every_power_of_two_cut() -> None:
    """Six experts: cuts of 6, 3 and 1 (6 // 2, 3 // 2). Counts where only the cut of 3 is
    the cheapest: two groups of three even loads."""
    counts = [100, 100, 100, 20, 20, 20]
    assert cost_chosen_groups(counts) == (Group((0, 1, 2), 100, 0), Group((3, 4, 5), 20, 300))
