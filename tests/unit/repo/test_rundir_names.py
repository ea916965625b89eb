"""The run directory's entries are named in one module: no module of `src/flashcp` but
`flashcp/rundir.py` spells one as a string literal (it asks `flashcp.rundir` instead)."""

from __future__ import annotations

import ast
from pathlib import Path

import flashcp
from flashcp import rundir

SRC = Path(flashcp.__file__).resolve().parent
HOME = SRC / "rundir.py"

NAMES = {*rundir.ENTRIES, rundir.LAUNCHER_LOG}
"""Every name `rundir` gives, but the generic words inside `logs/` (`eval`, `restarts`)."""
PREFIXES = (rundir.WORKER_LOG.split("{")[0],)
"""Patterns: an f-string starting `workerlog.` spells `WORKER_LOG`."""


def docstrings(tree: ast.AST) -> set[int]:
    """`id` of every docstring node (a module's, a class's, a function's, an attribute's)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                found.add(id(stmt.value))
    return found


def path_parts(tree: ast.AST) -> set[int]:
    """`id` of every operand of a `/` (a path joined: `out / "grads"`) and of every argument of
    a `Path(...)` / `os.path.join(...)` call."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found.update((id(node.left), id(node.right)))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("Path", "pathlib.Path", "os.path.join"):
                found.update(id(arg) for arg in node.args)
    return found


def spelled(source: str, names: set[str] = NAMES) -> list[tuple[int, str]]:
    """(line, literal) of each string literal in `source` that spells a run-directory entry: a
    file name (`config.yaml`) anywhere, any name joined into a path (`out / "grads"`), a path
    starting with a name (`"checkpoints/step_1"`), or a pattern's prefix. (A bare word that is
    also a name, such as the `"wandb"` backend or a layer's `"merged"` flag, is not a path.)"""
    tree = ast.parse(source)
    skip, joined = docstrings(tree), path_parts(tree)
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in skip:
            continue
        text = node.value
        named = text in names and ("." in text or id(node) in joined)
        if named or text.split("/")[0] in names and "/" in text or text.startswith(PREFIXES):
            hits.append((node.lineno, text))
    return hits


def test_no_module_but_rundir_spells_an_entry() -> None:
    found = {
        str(path.relative_to(SRC)): hits
        for path in sorted(SRC.rglob("*.py"))
        if path != HOME and (hits := spelled(path.read_text()))
    }
    assert found == {}, f"ask flashcp.rundir for these names: {found}"


def test_rundir_spells_them_and_the_scan_sees_a_literal() -> None:
    """Negative controls: a module that writes `"config.yaml"`, `out / "grads"`,
    `"checkpoints/step_2"` or `f"workerlog.{rank}"` is caught; a docstring that mentions them,
    or `"wandb"` as a backend's name, is not."""
    bad = (
        'def f(out, rank):\n    """Writes config.yaml."""\n'
        '    return (out / "grads", Path("logs"), "config.yaml", "checkpoints/step_2",\n'
        '            f"workerlog.{rank}", {"wandb": 1})\n'
    )
    got = sorted(text for _, text in spelled(bad))
    assert got == ["checkpoints/step_2", "config.yaml", "grads", "logs", "workerlog."]


def test_every_entry_is_documented() -> None:
    """Each name is a constant of `rundir` with its own docstring line (who, when, what)."""
    tree = ast.parse(HOME.read_text())
    body = tree.body
    documented = {
        stmt.targets[0].id
        for stmt, after in zip(body, body[1:], strict=False)
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    }  # fmt: skip
    values = {name: getattr(rundir, name) for name in documented}
    for name in (*rundir.ENTRIES, *rundir.LOG_ENTRIES):
        assert name in values.values(), f"{name!r} has no documented constant in rundir.py"
