"""The test suite's own layout: unit tests mirror `flashcp`'s packages, every directory of
tests is a package (pytest's default import mode needs that or unique basenames; two test
files with one basename broke CI once), and nothing reaches the helpers through `sys.path`."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_integration_items_run_in_their_xdist_lanes(request: pytest.FixtureRequest) -> None:
    """Under `-n 2 --dist loadgroup` (scripts/test.sh) every integration item's node id carries
    its lane's xdist group suffix (`@integration`, `@integration_2`; a one-process test may name
    its own), so each lane's launched jobs run one after another on one worker. The suite's
    collection hook must run before xdist's worker hook that turns the mark into the suffix,
    and pytest must be one whose node ids take it (pytest 9.2 silently dropped it:
    pytest-dev/pytest-xdist#1386). Without xdist: the hook's order and the lanes' modules."""
    conftest = [
        impl for impl in request.config.pluginmanager.hook.pytest_collection_modifyitems
        .get_hookimpls() if impl.plugin_name.endswith("tests/conftest.py")
    ]  # fmt: skip
    assert len(conftest) == 1 and conftest[0].tryfirst
    lanes = conftest[0].plugin.SECOND_LANE  # the plugin is the conftest module
    assert {n for n in lanes if not (TESTS / "integration" / f"{n}.py").is_file()} == set()
    if hasattr(request.config, "workerinput") and request.config.getvalue("loadgroup"):
        integration = [i for i in request.session.items if i.get_closest_marker("integration")]
        wrong = [
            i.nodeid for i in integration
            if not i.nodeid.endswith("@" + i.get_closest_marker("xdist_group").args[0])
        ]  # fmt: skip
        assert wrong == []
        second = {i.nodeid.rsplit("@", 1)[-1] for i in integration
                  if i.module.__name__.split(".")[-1] in lanes}  # fmt: skip
        assert second <= {"integration_2"}
