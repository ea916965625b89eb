"""Config errors: each names a dotted key and how to fix it; they are reported all at once.

A fix the validator offers as a change of config keys is data (`ConfigError.fixes`, each a set
of `key=value` overrides), not prose: before an error is printed, every fix is applied to the
config it was found in and validated (`prune_fixes`), and only the fixes that resolve the
problem without raising another one are kept (issue 27: "raise model.max_seq_len" for a model
whose config.json fixes it, "set parallel.cp to 3" where seq_len must then be a multiple of 6).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
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
class ConfigError:
    """One problem: the dotted `key` it is about, what is wrong (`problem`) and the way out:
    `fixes` (config changes, each validated before it is printed), `other` (a way that is not
    a config change, e.g. another launch command) or, for legacy messages, the problem text
    itself. `note` says where the value came from (`[set on the command line: ...]`)."""

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


def with_note(err: ConfigError, note: str) -> ConfigError:
    """`err` with `note` appended to where its value came from."""
    return dataclasses.replace(err, note=err.note + note)


Recheck = Callable[[list[str]], "list[ConfigError] | None"]
"""Validate the config again with extra `key=value` overrides: its problems (None: it could
not be checked)."""


def fix_works(fix: Fix, err: ConfigError, others: set[str], recheck: Recheck) -> bool:
    """Whether applying `fix` resolves `err` and leaves no problem but those about the keys of
    the other errors (`others`), which the user still has to fix anyway."""
    after = recheck(fix_overrides(fix))
    return after is not None and all(e.key in others for e in after)


def prune_fixes(errors: Sequence[ConfigError], recheck: Recheck) -> list[ConfigError]:
    """`errors` with only the fixes that work (`fix_works`): each is applied on top of the
    config's own overrides and the whole config validated again."""
    out = []
    for i, err in enumerate(errors):
        if err.fixes:
            others = {e.key for j, e in enumerate(errors) if j != i}
            good = tuple(f for f in err.fixes if fix_works(f, err, others, recheck))
            err = dataclasses.replace(err, fixes=good)
        out.append(err)
    return out


class ConfigValidationError(ValueError):
    """Raised with every problem found in a config (never just the first)."""

    def __init__(self, errors: Sequence[ConfigError], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        """One line for one problem; a heading and one line per problem for several."""
        where = f" in {self.source}" if self.source else ""
        n = len(self.errors)
        if n == 1:
            return f"config problem{where}: {self.errors[0]}"
        head = f"{n} config problems{where}:"
        return "\n".join([head, *(f"  - {e}" for e in self.errors)])


def suggest(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest `choices`, else the list of valid ones."""
    options = sorted(choices)
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.6)
    if close:
        return " (did you mean " + " or ".join(close) + "?)"
    return f" (valid keys: {', '.join(options)})" if options else ""
