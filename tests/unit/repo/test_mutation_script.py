"""`bash scripts/test.sh mutation` (`scripts/mutation.py`): which modules it mutates (those that
differ from main), against which tests (their package's unit tests), the work copy's mutmut
settings, and the score it prints. mutmut itself runs by hand, not in CI (minutes a module)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import mutation
from helpers.paths import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository shaped like flashcp's: a package, its tests, a committed main."""
    for name in ("src/flashcp/data/epochs.py", "src/flashcp/data/packing.py",
                 "src/flashcp/trainer.py", "src/flashcp/__init__.py",
                 "tests/unit/data/test_epochs.py", "tests/unit/test_trainer.py",
                 "configs/a.yaml", "README.md"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "flashcp"\n')
    (tmp_path / ".gitignore").write_text("/.mutation/\n")
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "main")
    return tmp_path


def test_changed_modules_are_those_that_differ_from_main(repo: Path) -> None:
    _git(repo, "checkout", "-qb", "feature")
    (repo / "src/flashcp/data/epochs.py").write_text("# changed, committed\n")
    _git(repo, "commit", "-qam", "change")
    (repo / "src/flashcp/trainer.py").write_text("# changed, not committed\n")
    (repo / "src/flashcp/data/new.py").write_text("# untracked\n")
    (repo / "src/flashcp/data/packing.py").unlink()  # deleted: nothing to mutate
    (repo / "README.md").write_text("# not a module\n")
    assert mutation.changed_modules("main", repo) == [
        "src/flashcp/data/epochs.py", "src/flashcp/data/new.py", "src/flashcp/trainer.py",
    ]  # fmt: skip
    _git(repo, "checkout", "-q", "-f", "main")
    (repo / "src/flashcp/data/new.py").unlink()
    assert mutation.changed_modules("main", repo) == []


def test_each_module_runs_against_its_packages_unit_tests(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLASHCP_MUTATION_TESTS", raising=False)
    assert mutation.unit_tests_for("src/flashcp/data/epochs.py", repo) == ["tests/unit/data"]
    assert mutation.unit_tests_for("src/flashcp/trainer.py", repo) == [
        "tests/unit/test_trainer.py"
    ]
    missing = (r"no unit tests of src/flashcp/__init__\.py at tests/unit/test___init__\.py: "
               r"name them with FLASHCP_MUTATION_TESTS")  # fmt: skip
    with pytest.raises(SystemExit, match=missing):
        mutation.unit_tests_for("src/flashcp/__init__.py", repo)
    monkeypatch.setenv("FLASHCP_MUTATION_TESTS", "tests/unit/data/test_epochs.py tests/x")
    assert mutation.unit_tests_for("src/flashcp/__init__.py", repo) == [
        "tests/unit/data/test_epochs.py", "tests/x",
    ]  # fmt: skip
    # the real tree: a package's tests and a top-level module's file exist
    monkeypatch.delenv("FLASHCP_MUTATION_TESTS")
    for module in ("src/flashcp/data/epochs.py", "src/flashcp/trainer.py"):
        (tests,) = mutation.unit_tests_for(module)
        assert (ROOT / tests).exists()


def test_module_paths_are_files_under_src(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert mutation.module_path("src/flashcp/data/epochs.py") == "src/flashcp/data/epochs.py"
    assert mutation.module_path(str(ROOT / "src/flashcp/trainer.py")) == "src/flashcp/trainer.py"
    with pytest.raises(SystemExit, match=r"tests/unit/data is not under .*/src"):
        mutation.module_path("tests/unit/data")
    with pytest.raises(SystemExit, match=r"src/flashcp/data is not a Python file"):
        mutation.module_path("src/flashcp/data")
    assert mutation.slug("src/flashcp/data/epochs.py") == "flashcp.data.epochs"


def test_the_work_copy_mutates_one_module_against_its_tests(repo: Path) -> None:
    (repo / "src/flashcp/data/epochs.py").write_text("# uncommitted: copied as it is\n")
    (repo / ".mutation" / "flashcp.data.epochs").mkdir(parents=True)
    (repo / ".mutation" / "flashcp.data.epochs" / "stale").write_text("a previous run")
    work = mutation.work_copy("src/flashcp/data/epochs.py", ["tests/unit/data"], repo)
    assert work == repo / ".mutation" / "flashcp.data.epochs"
    assert not (work / "stale").exists() and not (work / ".mutation").exists()
    assert (work / "src/flashcp/data/epochs.py").read_text() == "# uncommitted: copied as it is\n"
    assert (work / "mutants" / "src").is_dir()  # there before Python starts (module docstring)
    settings = tomllib.loads((work / "pyproject.toml").read_text())
    assert settings["project"]["name"] == "flashcp"
    assert settings["tool"]["mutmut"] == {
        "source_paths": ["src"],
        "only_mutate": ["src/flashcp/data/epochs.py"],
        "also_copy": [".gitignore", "README.md", "configs", "pyproject.toml", "tests"],
        "pytest_add_cli_args": ["-m", "not integration and not gpu and not hf", "-p",
                                "no:cacheprovider"],
        "pytest_add_cli_args_test_selection": ["tests/unit/data"],
        "use_git_change_detection": False,
    }  # fmt: skip


def test_the_score_counts_caught_and_missed_mutants() -> None:
    text = "\n".join([
        "    flashcp.data.epochs.x_passes__mutmut_1: killed",
        "    flashcp.data.epochs.x_passes__mutmut_2: survived",
        "    flashcp.data.epochs.x_passes__mutmut_3: timeout",
        "    flashcp.data.epochs.x_passes__mutmut_4: no tests",
        "    flashcp.data.epochs.x_passes__mutmut_5: killed",
        "    flashcp.data.epochs.x_passes__mutmut_6: skipped",
        "Saved something",
    ])  # fmt: skip
    score = mutation.parse_results(text)
    assert (score.caught, score.missed) == (3, 2) and score.percent == 60.0
    assert score.survivors() == [
        ("flashcp.data.epochs.x_passes__mutmut_2", "survived"),
        ("flashcp.data.epochs.x_passes__mutmut_4", "no tests"),
    ]
    assert score.line("m.py") == (
        "m.py: 60.0 % — 3 of 5 mutants caught (2 killed, 1 timed out); 1 survived, 1 run by "
        "no test, 0 suspicious, 1 skipped"
    )
    assert mutation.parse_results("").percent is None
