"""The planner's figures in the docs are today's planner's: every measured case of
docs/memory.json re-planned (its plan, and so each measured/predicted ratio the page and the
README report), the shipped GPU configs' plans, and docs/long_context.json's longest lengths
(the plan at each row's longest length, before and after). A planner change that moves any of
them fails here until the pages are regenerated (`python scripts/memory_check.py
--report-only`, `python scripts/bench_long_context.py`), so a page cannot keep figures the
code no longer gives. Negative controls: the same checks against a planner that counts one
thing differently fail."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from bench import long_context, memory_check
from flashcp.plan import GIB, plan
from flashcp.plan.counts import Dtypes
from flashcp.plan.longest import with_seq_len
from flashcp.plan.state import StageState
from helpers.paths import ROOT

DOCS = ROOT / "docs"


def _json(name: str) -> dict[str, Any]:
    return json.loads((DOCS / name).read_text())


def _replanned(case: dict[str, Any]) -> dict[str, Any]:
    fresh = copy.deepcopy(case)
    memory_check.replan(fresh)
    return fresh


def _memory_drift(rec: dict[str, Any]) -> list[str]:
    """The measured cases whose plan or ratios differ from the current planner's."""
    out = []
    for case in rec["cases"]:
        fresh = _replanned(case)
        if (fresh["plan"], fresh.get("ranks"), fresh.get("within")) != (
            case["plan"], case.get("ranks"), case.get("within")
        ):
            out.append(case["name"])
    return out


def _row_peaks(rec: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(row, side) → the device peak (GiB) of the plan at that row's longest length."""
    from flashcp.config import load_config

    specs = {spec["name"]: spec for spec in long_context.ROWS}
    out = {}
    for row in rec["rows"]:
        spec = specs[row["name"]]
        cfg = load_config(
            ROOT / spec["config"],
            [*spec["overrides"], *long_context._hardware_overrides()],
            allow_placeholders=True,
        )
        for side in ("before", "after"):
            best = row[side]
            new = long_context._variant(cfg, best["overrides"])
            assert new is not None, (row["name"], side)
            p = plan(with_seq_len(new, best["longest_seq_len"]))
            out[(row["name"], side)] = p.peak.total_bytes / GIB
    return out


def _stored_peaks(rec: dict[str, Any]) -> dict[tuple[str, str], float]:
    return {(row["name"], side): row[side]["device_peak_gib"]
            for row in rec["rows"] for side in ("before", "after")}  # fmt: skip


def test_memory_cases_are_planned_as_the_page_says() -> None:
    rec = _json("memory.json")
    assert all("plan" in case for case in rec["cases"])
    assert _memory_drift(rec) == []


def test_memory_check_notices_a_planner_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: CPU norms planned as Paddle's ops (keeping their inputs)."""
    monkeypatch.setattr(Dtypes, "numpy_rmsnorm", lambda self, norm: False)
    drift = _memory_drift(_json("memory.json"))
    assert len(drift) > 10, drift


def test_gpu_plans_are_the_current_planners() -> None:
    assert memory_check.gpu_plans() == _json("memory.json")["gpu_plans"]


def test_long_context_rows_are_planned_as_the_page_says() -> None:
    rec = _json("long_context.json")
    assert _row_peaks(rec) == _stored_peaks(rec)


def test_long_context_check_notices_a_planner_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: every gradient planned as present through every layer's backward."""

    def all_kept(self: StageState, index: int) -> tuple[int, int]:
        full = self.items[self.grad_item]
        return full, full

    monkeypatch.setattr(StageState, "layer_grads", all_kept)
    rec = _json("long_context.json")
    peaks, stored = _row_peaks(rec), _stored_peaks(rec)
    assert len([key for key in stored if peaks[key] != stored[key]]) >= len(stored) // 2
