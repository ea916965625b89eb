"""THE refusal: a `Problem` names what it is about (a dotted config key, or a file), what is
wrong and the way out; every check reports its findings as a list of them, and an entry point
refuses once, with every problem, by raising `ProblemsError` (issue 38, item 1).

The convention (`tests/unit/repo/test_problems_convention.py` pins it): a check is a function
`*_problems(...) -> list[Problem]`, empty when nothing is wrong; no check returns a message or
None, no check raises its finding. A leaf (it imports nothing of flashcp), so every layer's
checks — the config's, the data's, a model directory's, the memory plan's, the run
directory's — speak it.

A fix that is a change of config keys is data (`Problem.fixes`, each a set of `key=value`
overrides), not prose: before a problem is printed, every fix is applied to the config it was
found in and validated (`flashcp.config.errors.prune_fixes`), and only the fixes that resolve
the problem without raising another one are kept (issue 27).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Fix = tuple[tuple[str, Any], ...]
"""One fix: (dotted key, value) pairs applied together, as `key=value` overrides."""


def as_fix(values: Mapping[str, Any]) -> Fix:
    """A fix from a mapping of dotted keys to values (in the mapping's order)."""
    return tuple(values.items())


def override_value(value: Any) -> str:
    """`value` as the command line writes it (`true`, `null`, `[3,2]`, `1e-05`, `runs/x`)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def fix_overrides(fix: Fix) -> list[str]:
    """The `key=value` overrides of a fix."""
    return [f"{key}={override_value(value)}" for key, value in fix]


@dataclass(frozen=True)
class Problem:
    """One problem: the `key` it is about (a dotted config key, or a file or directory path),
    what is wrong (`problem`) and the way out: `fixes` (config changes, each validated before
    it is printed), `other` (a way that is not a config change, e.g. another launch command)
    or the problem text itself. `note` says where the value came from (`[set on the command
    line: ...]`)."""

    key: str
    problem: str
    fixes: tuple[Fix, ...] = ()
    other: str = ""
    note: str = ""

    @property
    def message(self) -> str:
        """The problem and every way out, as printed after the key."""
        ways = [f"set {' '.join(fix_overrides(fix))}" for fix in self.fixes]
        if self.other:
            ways.append(self.other)
        return self.problem + (": " + ", or ".join(ways) if ways else "") + self.note

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def with_note(problem: Problem, note: str) -> Problem:
    """`problem` with `note` appended to where its value came from."""
    return dataclasses.replace(problem, note=problem.note + note)


def one_line(text: str) -> str:
    """A multi-line message as one line (its lines joined by `; `), as a refusal prints it."""
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


class ProblemsError(ValueError):
    """The one refusal an entry point raises: every problem found (never just the first).
    `kind` names them in the printed text ("config problem in SOURCE: key: message"); a
    subclass whose caller already says what failed (the launcher's "cannot launch: ") sets it
    empty, and one problem prints as `key: message` alone."""

    kind = "config problem"

    def __init__(
        self, problems: Sequence[Problem], source: str | None = None, *, kind: str | None = None
    ) -> None:
        self.problems = list(problems)
        self.source = source
        if kind is not None:
            self.kind = kind
        super().__init__(self.render())

    def render(self) -> str:
        """One line for one problem; a heading and one line per problem for several."""
        where = f" in {self.source}" if self.source else ""
        n = len(self.problems)
        kind = self.kind or "problem"
        if n == 1:
            return f"{kind}{where}: {self.problems[0]}" if self.kind or where else (
                str(self.problems[0])
            )  # fmt: skip
        head = f"{n} {kind}s{where}:"
        return "\n".join([head, *(f"  - {e}" for e in self.problems)])
