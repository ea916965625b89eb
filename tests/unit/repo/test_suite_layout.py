"""The test suite's own layout: unit tests mirror `flashcp`'s packages, every directory of
tests is a package (pytest's default import mode needs that or unique basenames; two test
files with one basename broke CI once), and nothing reaches the helpers through `sys.path`."""

from __future__ import annotations

from pathlib import Path

from helpers.paths import ROOT, TESTS

UNIT = TESTS / "unit"
OUTSIDE_FLASHCP = {"bench", "repo"}
"""Unit-test directories that mirror no `flashcp` package: `scripts/bench`, and the repository's
own files (CI workflows, shell scripts, the install scheme, shipped configs, this layout)."""


def _test_dirs() -> list[Path]:
    return sorted({p.parent for p in TESTS.rglob("test_*.py")})


def test_every_directory_of_tests_is_a_package() -> None:
    missing = [d.relative_to(ROOT).as_posix() for d in _test_dirs()
               if not (d / "__init__.py").is_file()]  # fmt: skip
    assert missing == []
    assert not (TESTS / "__init__.py").exists()  # tests/ is on sys.path, not a package itself


def test_unit_directories_mirror_the_packages() -> None:
    packages = {p.parent.name for p in (ROOT / "src" / "flashcp").glob("*/__init__.py")}
    dirs = {d.name for d in UNIT.iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert dirs - packages == OUTSIDE_FLASHCP


def test_no_test_edits_sys_path() -> None:
    """`helpers` and `bench` come from pytest's `pythonpath` (launched workers: `PYTHONPATH`)."""
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in sorted(TESTS.rglob("*.py"))
        if p != Path(__file__).resolve() and "sys.path.insert" in p.read_text()
    ]
    assert offenders == []
