"""The benchmark library (`scripts/bench/`: rounds, stats, machine, report) and the boundary
between scripts and tests: no test loads a script by file path, no script imports from tests/
(the scripts sit below the tests, which import them by name through pytest's `pythonpath`)."""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
from pathlib import Path

import pytest

from bench import dpo, machine, report, stats
from bench.rounds import interleave
from helpers.paths import ROOT


def test_interleave_rotates_the_sides_every_round_warmup_included() -> None:
    rounds = list(interleave(["a", "b", "c"], 3, warmup=1))
    assert [r.index for r in rounds] == [0, 1, 2, 3]
    assert [r.timed for r in rounds] == [False, True, True, True]
    assert [r.order for r in rounds] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"],
    ]  # fmt: skip
    # two sides alternate; rotate=False keeps the given order (a baseline always first)
    assert [r.order for r in interleave(["x", "y"], 3)] == [["x", "y"], ["y", "x"], ["x", "y"]]
    assert {tuple(r.order) for r in interleave(["x", "y"], 3, rotate=False)} == {("x", "y")}


def test_statistics() -> None:
    assert stats.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert stats.spread([4.0, 1.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}
    assert stats.spread([]) is None and math.isnan(stats.median([]))
    assert stats.ratios([2.0, 6.0, 1.0], [1.0, 3.0, 0.0]) == [2.0, 2.0]  # a zero time is skipped
    assert stats.ratio_of_medians([4.0, 2.0, 6.0], [1.0, 2.0, 3.0]) == 2.0


def test_machine_load_is_recorded_around_a_block() -> None:
    with machine.load_window() as load:
        assert load.before and not load.after
    assert len(load.after) == 3
    assert load.as_dict() == {"loadavg_before": load.before, "loadavg_after": load.after}
    busy, total, ncpu = machine.cpu_jiffies()
    assert 0 <= busy <= total and ncpu >= 1
    assert machine.cpu_model()


def test_formatting_filters() -> None:
    assert report.fmt(None, ".2f") == "–" and report.fmt(1234.5, ",.0f") == "1,234"
    assert report.span([1.0, 1.00001]) == "1.0000"  # both ends read the same: one number
    assert report.span([0.5, 2.0], ".2f") == "0.50–2.00"
    assert report.spread({"median": 2.0, "min": 1.0, "max": 3.0}, ".1f") == "2.0 (1.0–3.0)"
    assert report.spread(None) == "–"


def test_every_template_compiles() -> None:
    names = report.ENV.list_templates()
    assert "macros.md.j2" in names and len(names) >= 10
    for name in names:
        report.ENV.get_template(name)


def test_a_page_is_written_and_rewritten_from_its_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = dpo.PAGE
    parser = argparse.ArgumentParser()
    page.add_arguments(parser)
    args = parser.parse_args(["--json", str(tmp_path / "b.json")])
    assert not args.report_only and page.paths(args) == (tmp_path / "b.json", tmp_path / "b.md")
    rec = json.loads((ROOT / "docs" / "bench_dpo.json").read_text())
    text = page.write(args, rec)
    assert (tmp_path / "b.md").read_text() == text == page.render(rec)
    assert json.loads((tmp_path / "b.json").read_text()) == rec
    (tmp_path / "b.md").unlink()
    assert page.rewrite(args) == 0 and (tmp_path / "b.md").read_text() == text
    assert "wrote" in capsys.readouterr().out


def test_no_test_loads_a_script_by_file_path() -> None:
    """Tests import scripts code by name (`from bench import kernel`, pytest's pythonpath)."""
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in sorted((ROOT / "tests").rglob("*.py"))
        if p != Path(__file__).resolve()
        and "spec_from_file_location" in p.read_text()
        and "scripts" in p.read_text()
    ]
    assert offenders == []


def _code_strings(tree: ast.AST) -> list[str]:
    """The string constants of a module that are not docstrings."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_script_imports_from_tests() -> None:
    """Scripts sit below the tests: they import nothing that lives under tests/ (no `helpers`,
    no `sys.path` entry for it) and name no path there but the goldens
    `scripts/update_golden.py` writes (`tests/golden/`). What both sides need lives on the
    scripts' side (`bench.jobs`, `bench.numerics`) or in the library (`flashcp.launch`).
    `scripts/mutation.py` is the test runner's own (`scripts/test.sh mutation`): it names the
    unit-test folder of each mutated module, and imports nothing from it."""
    reaching = {
        p.relative_to(ROOT).as_posix()
        for p in sorted((ROOT / "scripts").rglob("*.py"))
        if re.search(r"""["']tests["']""", p.read_text()) and p.name != "mutation.py"
    }
    assert reaching == set()
    test_modules = {p.stem for p in (ROOT / "tests").iterdir() if p.suffix == ".py" or p.is_dir()}
    assert {"helpers", "unit", "integration", "conftest"} <= test_modules
    found = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        tree = ast.parse(path.read_text())
        runner = path.name == "mutation.py"  # may name tests/, never import from it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""
                ]
                found += [f"{path.name} imports {n}" for n in names
                          if n.split(".")[0] in test_modules]  # fmt: skip
        found += [
            f"{path.name} names {text!r}"
            for text in _code_strings(tree)
            if re.fullmatch(r"(\S*/)?tests(/\S*)?", text) and "tests/golden/" not in text
            and not runner
        ]
    assert found == []
