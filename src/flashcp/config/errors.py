"""Config errors: each names a dotted key and how to fix it; they are reported all at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigError:
    """One problem: the dotted `key` it is about and a `message` that says what to change."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigValidationError(ValueError):
    """Raised with every problem found in a config (never just the first)."""

    def __init__(self, errors: Sequence[ConfigError], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        where = f" in {self.source}" if self.source else ""
        n = len(self.errors)
        head = f"{n} config problem{'s' if n != 1 else ''}{where}:"
        return "\n".join([head, *(f"  - {e}" for e in self.errors)])


def suggest(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest `choices`, else the list of valid ones."""
    options = sorted(choices)
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.6)
    if close:
        return " (did you mean " + " or ".join(close) + "?)"
    return f" (valid keys: {', '.join(options)})" if options else ""
