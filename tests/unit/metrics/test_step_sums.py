"""`flashcp.metrics.step_sums.StepSums`: named blocks of one vector, summed in ONE all-reduce."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from flashcp.metrics import step_sums
from flashcp.metrics.step_sums import StepSums


def test_blocks_travel_in_one_vector_and_come_back_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[list[float], Any]] = []

    def two_equal_ranks(values: Any, groups: Any) -> np.ndarray:
        seen.append((np.asarray(values).tolist(), groups))
        return np.asarray(values) * 2.0

    monkeypatch.setattr(step_sums, "all_reduce_values", two_equal_ranks)
    sums = StepSums(rank=1, world=3)
    sums.add("loss", [0.5])
    sums.per_rank("bad", 1.0)
    sums.add("none", [])
    sums.add("recipe", np.array([1.0, 2.0]))
    out = sums.all_reduce(["cp", "dp"])
    assert seen == [([0.5, 0.0, 1.0, 0.0, 1.0, 2.0], ["cp", "dp"])]  # in the order added
    assert list(out) == ["loss", "bad", "none", "recipe"]
    assert out["loss"].tolist() == [1.0]
    assert out["bad"].tolist() == [0.0, 2.0, 0.0]  # this rank's slot
    assert out["none"].size == 0 and out["recipe"].tolist() == [2.0, 4.0]


def test_without_groups_the_values_come_back_unchanged() -> None:
    sums = StepSums(rank=0, world=1)
    sums.per_rank("peak", 7.0)
    sums.add("routing", [])
    out = sums.all_reduce([None])
    assert out["peak"].tolist() == [7.0] and out["routing"].size == 0
    assert StepSums(0, 1).all_reduce([]) == {}
