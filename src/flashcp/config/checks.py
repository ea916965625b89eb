"""The collector every cross-field config rule reports to: `Checks` (problems by dotted key, no
cascades) and the small helpers rules share.

`flashcp.config.validate.check_config` makes one `Checks` and runs the core rules
(`flashcp.config.validate`, `flashcp.config.layout_rules`) and the run's recipe's own
(`RecipeSpec.rules`, `flashcp.config.recipes`) against it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flashcp.problems import Problem, as_fix


class Checks:
    """Collects problems, dropping those about keys that already have a type error (or an
    earlier rule's error)."""

    def __init__(self, skip: Iterable[str]) -> None:
        self.skip = set(skip)
        self.problems: list[Problem] = []

    def ok(self, *keys: str) -> bool:
        """None of `keys` has a problem yet."""
        return not any(k in self.skip for k in keys)

    def add(
        self,
        key: str,
        message: str,
        *also: str,
        fixes: Iterable[dict[str, Any]] = (),
        other: str = "",
    ) -> None:
        """Report `message` about `key` (unless it or one of `also` already failed), with the
        `fixes` that resolve it (`{dotted key: value}` each, validated before printing:
        `flashcp.config.errors.prune_fixes`) and any `other` way out."""
        if self.ok(key, *also):
            unique: list[Any] = []
            for fix in map(as_fix, fixes):
                if fix not in unique:
                    unique.append(fix)
            self.problems.append(Problem(key, message, tuple(unique), other))
            self.skip.add(key)


def positive(c: Checks, key: str, value: float, *, zero_ok: bool = False) -> None:
    """`key` must be > 0 (>= 0 with `zero_ok`)."""
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        c.add(key, f"must be {bound}, got {value}")
