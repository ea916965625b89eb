"""Every benchmark page and the README's "Measured here" table are generated from the committed
JSON: regenerating them from docs/*.json must reproduce the committed text exactly, so no figure
in prose or tables can drift from its data. Negative control: changing one number in the data
changes the page."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench import (
    balance,
    checkpoint_stall,
    cp_pages,
    dpo,
    kernel,
    long_context,
    loss_memory,
    memory_check,
    moe,
    resilience,
    tiling_memory,
)
from bench import readme_table as tables
from helpers.paths import ROOT

DOCS = ROOT / "docs"


def _json(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def test_cp_pages_match_their_json() -> None:
    docs = cp_pages
    comm, scaling = _json("cp_comm.json"), _json("cp_scaling.json")
    assert (DOCS / "cp_bench.md").read_text() == docs.render_cp_bench(comm, scaling)
    model, timed = _json("cp_balance.json"), _json("cp_balance_time.json")
    assert (DOCS / "cp_balance.md").read_text() == docs.render_cp_balance(model, timed)
    changed = copy.deepcopy(scaling)
    changed["speedup"]["total"] += 0.5
    assert docs.render_cp_bench(comm, changed) != docs.render_cp_bench(comm, scaling)


def test_kernel_page_matches_its_json() -> None:
    report = _json("bench_kernel.json")
    assert (DOCS / "bench_kernel.md").read_text() == kernel.PAGE.render(report)


def test_dpo_page_matches_its_json() -> None:
    rec = _json("bench_dpo.json")
    assert (DOCS / "bench_dpo.md").read_text() == dpo.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["speedup"]["median"] *= 2
    assert dpo.PAGE.render(changed) != dpo.PAGE.render(rec)


def test_balance_page_matches_its_json() -> None:
    rec = _json("balance.json")
    assert (DOCS / "balance.md").read_text() == balance.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["model"]["cases"][0]["work"]["dp"]["mean"] += 0.5
    assert balance.PAGE.render(changed) != balance.PAGE.render(rec)


def test_loss_memory_page_matches_its_json() -> None:
    rec = _json("loss_memory.json")
    assert (DOCS / "loss_memory.md").read_text() == loss_memory.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["cases"][0]["peak_ratio"] *= 2
    assert loss_memory.PAGE.render(changed) != loss_memory.PAGE.render(rec)


def test_tiling_memory_page_matches_its_json() -> None:
    rec = _json("tiling_memory.json")
    assert (DOCS / "tiling_memory.md").read_text() == tiling_memory.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["cases"][0]["peak_slope"] *= 2
    assert tiling_memory.PAGE.render(changed) != tiling_memory.PAGE.render(rec)


def test_checkpoint_stall_page_matches_its_json() -> None:
    rec = _json("checkpoint_stall.json")
    assert (DOCS / "checkpoint_stall.md").read_text() == checkpoint_stall.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["ratio"]["median"] = 0.5
    page = checkpoint_stall.PAGE.render(changed)
    assert page != checkpoint_stall.PAGE.render(rec) and "target ≤ 0.2: NOT met" in page


def test_readme_table_matches_the_json(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    assert tables.readme_with_table(text) == text, "run python scripts/readme_table.py --write"
    assert tables.main(["--check"]) == 0
    # negative control: one changed figure in the data makes the README stale
    for name in ("cp_scaling.json", "bench_kernel.json", "cp_comm.json", "bench_dpo.json"):
        (tmp_path / name).write_text((DOCS / name).read_text())
    scaling = json.loads((tmp_path / "cp_scaling.json").read_text())
    scaling["speedup"]["total"] += 0.5
    (tmp_path / "cp_scaling.json").write_text(json.dumps(scaling))
    assert tables.main(["--check", "--docs", str(tmp_path)]) == 1
    with pytest.raises(ValueError, match="lacks the markers"):
        tables.readme_with_table("# no table here\n")


def test_moe_page_matches_its_json() -> None:
    rec = _json("moe.json")
    assert (DOCS / "moe.md").read_text() == moe.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["cases"][0]["variants"]["grouped"]["speedup"] += 1.0
    assert moe.PAGE.render(changed) != moe.PAGE.render(rec)


def test_memory_page_and_readme_rows_match_their_json(tmp_path: Path) -> None:
    """docs/memory.md is `bench.memory_check`'s page of docs/memory.json; the README's planner
    rows (accuracy, the largest config on one 8×H20 node) come from the same JSON."""
    rec = _json("memory.json")
    assert (DOCS / "memory.md").read_text() == memory_check.PAGE.render(rec)
    rows = _memory_rows(DOCS)
    assert len(rows) == 4 and "within ±15 %" in rows[0][1] and "8×H20" in rows[1][0]
    assert "torchtitan" in rows[2][0] and f"{rec['torchtitan']['rows'][0]['peak_gib']:.1f} GiB" \
        in rows[2][1]
    changed = copy.deepcopy(rec)
    changed["cases"][0]["ranks"][0]["ratio"] = 1.5  # one rank off by 50 %
    changed["cases"][0]["within"] = False
    assert memory_check.PAGE.render(changed) != memory_check.PAGE.render(rec)
    (tmp_path / "memory.json").write_text(json.dumps(changed))
    worse = _memory_rows(tmp_path)
    within = sum(bool(c["within"]) for c in rec["cases"])
    assert rows[0][1].startswith(f"{within} of {len(rec['cases'])} configs within")
    assert worse[0][1].startswith(f"{within - 1} of ") and "worst 1.500" in worse[0][1]


def _memory_rows(docs: Path) -> list[tuple[str, str, str]]:
    """The README table's rows from docs/memory.json (the planner's)."""
    return [row for row in tables.rows(docs) if row[2] == "`docs/memory.md`"]


def test_long_context_page_and_readme_rows_match_their_json(tmp_path: Path) -> None:
    """docs/long_context.md is `bench.long_context`'s page of docs/long_context.json, and the
    README's long-context rows come from the same JSON."""
    rec = _json("long_context.json")
    assert (DOCS / "long_context.md").read_text() == long_context.PAGE.render(rec)
    rows = [row for row in tables.rows(DOCS) if row[2] == "`docs/long_context.md`"]
    assert len(rows) == 3 and "8×H20" in rows[0][0] and "ALST" in rows[0][0]
    first = rec["rows"][0]
    assert f"{first['after']['longest_seq_len']:,}" in rows[0][1]
    assert f"({first['after']['without_margins_seq_len']:,})" in rows[0][1]  # no margin
    assert "~1 min / ~10 min" in rows[1][0]  # the practical lengths
    changed = copy.deepcopy(rec)
    changed["rows"][0]["after"]["longest_seq_len"] = 1234
    assert long_context.PAGE.render(changed) != long_context.PAGE.render(rec)
    assert "NOT met by the plan" in long_context.PAGE.render(changed)  # below the 4M target
    (tmp_path / "long_context.json").write_text(json.dumps(changed))
    assert "→ **1,234**" in [r for r in tables.rows(tmp_path) if "8×H20" in r[0]][0][1]


def test_reliability_section_matches_its_json() -> None:
    rec = _json("resilience.json")
    text = (DOCS / "reliability.md").read_text()
    assert resilience.with_section(text, rec) == text, "scripts/bench_resilience.py --report-only"
    changed = copy.deepcopy(rec)
    changed["goodput"]["productive_s"] += 1.0
    assert resilience.section(changed) != resilience.section(rec)
