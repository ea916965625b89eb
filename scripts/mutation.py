"""Mutation testing of the modules a change touched: `bash scripts/test.sh mutation [PATH ...]`.

For each module (default: the `src/**.py` files that differ from the merge base with `main`,
uncommitted and untracked changes included; `FLASHCP_MUTATION_BASE` names another ref), mutmut
(`MUTMUT_SPEC`, installed on first use into `.venv/mutmut`, like the hf tier's torch) mutates
that module alone and runs the unit tests of its package against each mutant
(`tests/unit/<package>/`, or `tests/unit/test_<module>.py` for a top-level module;
`FLASHCP_MUTATION_TESTS` overrides), then prints the score — the share of mutants some test
catches — and the diff of every mutant that survived. Not part of CI (minutes per module):
run it before calling a change done. A survivor is either a missing test or a mutant that
changes nothing (an equivalent mutant), to be explained.

Each module runs in its own copy of the working tree, `.mutation/<module>/` (git-ignored, made
anew each run; `python -m mutmut show NAME` there shows a mutant again), because mutmut writes
its mutated copy (`mutants/`) and its results inside the directory it runs in.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT_SPEC = ("mutmut==3.8.1", "libcst==1.9.0", "setproctitle==1.3.8")
"""Installed with --no-deps: mutmut's other dependencies (click, rich, coverage, pytest, PyYAML
for libcst) come with the project's own install, and a second pytest would shadow the pinned one."""
FROM_THE_VENV = ("click", "rich", "coverage", "pytest", "yaml")
WORK_DIR = ".mutation"
UNIT = "not integration and not gpu and not hf"
"""The unit tier's marker expression (scripts/test.sh unit)."""

CAUGHT = ("killed", "timeout", "segfault", "caught by type check")
MISSED = ("survived", "no tests", "suspicious")
"""`no tests`: no test of the package runs the mutated function; `suspicious`: the tests ended
in a way mutmut cannot read as a failure — counted as not caught."""


def changed_modules(base: str, root: Path = ROOT) -> list[str]:
    """The `src/**.py` files that differ from the merge base of HEAD and `base` (the working
    tree: uncommitted and untracked files included, deleted ones not)."""
    merge_base = _git(["merge-base", "HEAD", base], root).strip()
    diff = _git(["diff", "--name-only", "--diff-filter=d", merge_base, "--", "src/*.py"], root)
    new = _git(["ls-files", "--others", "--exclude-standard", "--", "src/*.py"], root)
    return sorted({line for line in (diff + new).splitlines() if line.strip()})


def default_base(root: Path = ROOT) -> str:
    """`FLASHCP_MUTATION_BASE`, else `main`, else `origin/main` (a fresh clone of a branch)."""
    if base := os.environ.get("FLASHCP_MUTATION_BASE"):
        return base
    for ref in ("main", "origin/main"):
        probe = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", ref],
            cwd=root,
            capture_output=True,
            check=False,
        )
        if probe.returncode == 0:
            return ref
    raise SystemExit(
        "mutation: no `main` or `origin/main` to diff against: name the modules "
        "(bash scripts/test.sh mutation src/flashcp/PATH.py) or set "
        "FLASHCP_MUTATION_BASE=REF"
    )


def module_path(arg: str, root: Path = ROOT) -> str:
    """`arg` (a path to a module under `src/`) relative to the repository root; SystemExit
    naming it otherwise."""
    path = Path(arg)
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    try:
        rel = path.relative_to(root / "src")
    except ValueError:
        raise SystemExit(
            f"mutation: {arg} is not under {root / 'src'}: give a module of "
            "src/flashcp, e.g. src/flashcp/data/epochs.py"
        ) from None
    if path.suffix != ".py" or not path.is_file():
        raise SystemExit(
            f"mutation: {arg} is not a Python file: give a module of src/flashcp, "
            "e.g. src/flashcp/data/epochs.py"
        )
    return str(Path("src") / rel)


def unit_tests_for(module: str, root: Path = ROOT) -> list[str]:
    """The unit tests of `module`'s package (tests mirror the package: docs/testing.md,
    "The tiers"): `tests/unit/<package>/` for `src/flashcp/<package>/...`,
    `tests/unit/test_<name>.py` for a top-level `src/flashcp/<name>.py`;
    `FLASHCP_MUTATION_TESTS` (paths, space-separated) overrides. SystemExit when none is
    found."""
    if override := os.environ.get("FLASHCP_MUTATION_TESTS"):
        return override.split()
    parts = Path(module).parts  # ("src", "flashcp", ..., "name.py")
    if len(parts) > 3:
        candidate = Path("tests", "unit", parts[2])
    else:
        candidate = Path("tests", "unit", f"test_{Path(parts[-1]).stem}.py")
    if not (root / candidate).exists():
        raise SystemExit(
            f"mutation: no unit tests of {module} at {candidate}: name them with "
            "FLASHCP_MUTATION_TESTS='tests/unit/...'"
        )
    return [str(candidate)]


def install_mutmut(python: str, target: Path) -> None:
    """`MUTMUT_SPEC` into `target` (pip --target, once per spec: a stamp file records it),
    then a check that mutmut imports with the venv's packages."""
    stamp = target / ".flashcp-installed"
    spec = " ".join(MUTMUT_SPEC)
    if not stamp.is_file() or stamp.read_text().strip() != spec:
        print(f"== installing {spec} into {target} (mutation testing only)", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        done = subprocess.run(
            [*pip, "--no-deps", "--target", str(target), *MUTMUT_SPEC],
            capture_output=True,
            text=True,
            check=False,
        )
        noise = re.compile(r"^WARNING: Location .* is ignored|^\s*$")
        for line in (done.stdout + done.stderr).splitlines():
            if not noise.match(line):
                print(line)
        if done.returncode != 0:
            raise SystemExit(f"mutation: installing {spec} failed (pip exit {done.returncode})")
        stamp.write_text(spec + "\n")
    probe = "import importlib, sys\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in (*FROM_THE_VENV, "mutmut.__main__")
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [python, "-c", probe], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(
            f"mutation: mutmut does not import from {target}: {last}; install the "
            "project first (bash scripts/test.sh installs it into .venv)"
        )


def slug(module: str) -> str:
    """`src/flashcp/data/epochs.py` → `flashcp.data.epochs` (the module's work directory)."""
    return ".".join(Path(module).with_suffix("").parts[1:])


def work_copy(module: str, tests: list[str], root: Path = ROOT) -> Path:
    """A fresh copy of the working tree (`git ls-files`: tracked and untracked files, the
    ignored ones left out) in `.mutation/<module>/`, its pyproject.toml given the mutmut
    settings: this module alone mutated, `tests` selected, the unit tier's markers."""
    work = root / WORK_DIR / slug(module)
    if work.exists():
        shutil.rmtree(work)
    files = _git(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], root)
    for name in sorted({f for f in files.split("\0") if f}):
        src = root / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            dest = work / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    tops = sorted(p.name for p in work.iterdir() if p.name not in ("src", "mutants"))
    settings = {
        "source_paths": ["src"],
        "only_mutate": [module],
        "also_copy": tops,  # what the tests read by path (configs, fixtures, docs, ...)
        "pytest_add_cli_args": ["-m", UNIT, "-p", "no:cacheprovider"],
        "pytest_add_cli_args_test_selection": tests,
        "use_git_change_detection": False,
    }
    lines = ["", "[tool.mutmut]"] + [f"{k} = {_toml(v)}" for k, v in settings.items()]
    with (work / "pyproject.toml").open("a") as f:
        f.write("\n".join(lines) + "\n")
    # The mutated tree must exist before Python starts: an import path that is missing at
    # start-up is cached as absent, and the tests would import the unmutated package.
    (work / "mutants" / "src").mkdir(parents=True)
    return work


@dataclass
class Score:
    """A module's mutants by mutmut status."""

    statuses: dict[str, str] = field(default_factory=dict)
    """Mutant name → status (`mutmut results --all true`)."""

    @property
    def counts(self) -> Counter[str]:
        return Counter(self.statuses.values())

    @property
    def caught(self) -> int:
        return sum(self.counts[s] for s in CAUGHT)

    @property
    def missed(self) -> int:
        return sum(self.counts[s] for s in MISSED)

    @property
    def percent(self) -> float | None:
        judged = self.caught + self.missed
        return 100.0 * self.caught / judged if judged else None

    def survivors(self) -> list[tuple[str, str]]:
        return sorted((n, s) for n, s in self.statuses.items() if s in MISSED)

    def line(self, module: str) -> str:
        c = self.counts
        pct = "n/a" if self.percent is None else f"{self.percent:.1f} %"
        other = {s: n for s, n in c.items() if s not in CAUGHT + MISSED}
        tail = "".join(f", {n} {s}" for s, n in sorted(other.items()))
        return (
            f"{module}: {pct} — {self.caught} of {self.caught + self.missed} mutants "
            f"caught ({c['killed']} killed, {c['timeout']} timed out); {c['survived']} "
            f"survived, {c['no tests']} run by no test, {c['suspicious']} suspicious{tail}"
        )


_RESULT = re.compile(r"^\s+(\S+): (.+)$")


def parse_results(text: str) -> Score:
    """`mutmut results --all true` output as a `Score`."""
    return Score({m[1]: m[2].strip() for line in text.splitlines() if (m := _RESULT.match(line))})


def run_module(module: str, python: str, target: Path, jobs: int, root: Path = ROOT) -> Score:
    """Mutate `module` against its package's unit tests; print its score and survivors."""
    tests = unit_tests_for(module, root)
    work = work_copy(module, tests, root)
    log = work / "mutmut.log"
    print(
        f"== mutation: {module} against {' '.join(tests)} ({jobs} workers; log {log})", flush=True
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{target}{os.pathsep}{work / 'mutants' / 'src'}",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }

    def mutmut(*args: str, out: Path | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [python, "-m", "mutmut", *args]
        if out is None:
            return subprocess.run(
                cmd, cwd=work, env=env, capture_output=True, text=True, check=False
            )
        with out.open("w") as f:
            return subprocess.run(
                cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, check=False
            )

    ran = mutmut("run", "--max-children", str(jobs), out=log)
    if ran.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(
            f"{tail}\nmutation: mutmut failed on {module} (exit {ran.returncode}; "
            f"the whole log: {log})"
        )
    score = parse_results(mutmut("results", "--all", "true").stdout)
    if not score.statuses:
        raise SystemExit(f"mutation: mutmut reported no mutant of {module} (log: {log})")
    print("   " + score.line(module))
    for name, status in score.survivors():
        print(f"-- {status}: {name}")
        print(mutmut("show", name).stdout.rstrip())
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bash scripts/test.sh mutation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "modules",
        nargs="*",
        metavar="PATH",
        help="modules under src/ (default: those changed against main)",
    )
    jobs = int(os.environ.get("FLASHCP_MUTATION_JOBS", os.cpu_count() or 2))
    parser.add_argument(
        "--jobs",
        type=int,
        default=jobs,
        help="mutants tested at once (default: FLASHCP_MUTATION_JOBS, else the cores)",
    )
    args = parser.parse_args(argv)
    if args.modules:
        modules = [module_path(m) for m in args.modules]
    else:
        base = default_base()
        modules = changed_modules(base)
        if not modules:
            print(
                f"mutation: no module under src/ differs from {base}: nothing to mutate "
                "(name modules to mutate them anyway)"
            )
            return 0
        print(f"== modules changed against {base}: {' '.join(modules)}")
    python = sys.executable
    target = ROOT / ".venv" / "mutmut"
    install_mutmut(python, target)
    scores = {m: run_module(m, python, target, max(1, args.jobs)) for m in modules}
    print("== mutation scores (caught / caught + missed; target >= 95 % per changed module)")
    for module, score in scores.items():
        print("   " + score.line(module))
    return 0


def _git(args: list[str], root: Path) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"mutation: git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


if __name__ == "__main__":
    sys.exit(main())
