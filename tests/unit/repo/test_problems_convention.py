"""One refusal vocabulary (issue 38, item 1): a check reports `list[Problem]`
(`flashcp.problems`) under a `*_problems` name; no function is a `*_refusal` returning a message
or None, and no `*_problems` / `check_*` / `*_conflict` function returns `str | None`; a
refusal that is a `ProblemsError` (`PreflightError`, `RunLockError`) is raised with `Problem`s,
never with a message written in place."""

from __future__ import annotations

import ast
from pathlib import Path

import flashcp

SRC = Path(flashcp.__file__).resolve().parent


def violations(source: str, where: str = "<text>") -> list[str]:
    """Every function of `source` that breaks the convention, as `where:line name: why`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        name = node.name
        returns = ast.unparse(node.returns).replace(" ", "") if node.returns else ""
        at = f"{where}:{node.lineno} {name}"
        if name.endswith("_refusal"):
            found.append(f"{at}: a `*_refusal`; report `list[Problem]` as `*_problems`")
        if name.endswith("_problems") and returns != "list[Problem]":
            found.append(f"{at}: returns {returns or 'unannotated'}, not list[Problem]")
        checks = name.startswith("check_") or name.endswith(("_problems", "_conflict"))
        if checks and returns in (
            "str|None", "None|str", "Optional[str]"
        ):  # fmt: skip
            found.append(f"{at}: a check returning a message or None")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _name(node.func) in PROBLEM_ERRORS and node.args and (
            isinstance(node.args[0], (ast.JoinedStr, ast.BinOp))
            or isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
        ):  # fmt: skip
            found.append(f"{where}:{node.lineno} {_name(node.func)}: raised with a message, "
                         "not a Problem")  # fmt: skip
    return found


PROBLEM_ERRORS = {"ProblemsError", "PreflightError", "RunLockError"}
"""The refusals that carry `Problem`s."""


def _name(func: ast.expr) -> str:
    """`X` of a call to `X(...)` or `module.X(...)`."""
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def test_every_check_reports_problems() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(SRC)))
    assert found == [], "\n".join(found)


def test_a_refusal_returning_a_message_is_found() -> None:
    """Negative control: the shapes the convention replaced are each refused."""
    bad = '''
def memory_refusal(cfg) -> str | None: ...
def data_problems(cfg) -> list[str]: ...
def check_dispatch(cfg) -> str | None: ...
def start_conflict(out, resume) -> str | None: ...
def good_problems(cfg) -> list[Problem]: ...
def master(m):
    raise PreflightError(f"--master {m!r} is not HOST:PORT")
def lock(d):
    raise runlock.RunLockError("run.output_dir " + d + " is in use")
def good(d):
    raise PreflightError(Problem("run.output_dir", f"{d} is in use"))
'''
    found = violations(bad)
    assert [f.split(":")[1].split()[1] for f in found] == [
        "memory_refusal", "data_problems", "check_dispatch", "start_conflict", "PreflightError",
        "RunLockError",
    ]  # fmt: skip
