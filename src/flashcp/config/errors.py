"""The config's side of a refusal (`flashcp.problems.Problem`): every fix a problem offers is
applied to the config it was found in and validated (`prune_fixes`), and only the fixes that
resolve the problem without raising another one are kept (issue 27: "raise
model.max_seq_len" for a model whose config.json fixes it, "set parallel.cp to 3" where seq_len
must then be a multiple of 6); `suggest` names the key a misspelt one meant.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Sequence

from flashcp.problems import Fix, Problem, fix_overrides

Recheck = Callable[[list[str]], "list[Problem] | None"]
"""Validate the config again with extra `key=value` overrides: its problems (None: it could
not be checked)."""


def fix_works(fix: Fix, err: Problem, others: set[str], recheck: Recheck) -> bool:
    """Whether applying `fix` resolves `err` and leaves no problem but those about the keys of
    the other errors (`others`), which the user still has to fix anyway."""
    after = recheck(fix_overrides(fix))
    return after is not None and all(e.key in others for e in after)


def prune_fixes(errors: Sequence[Problem], recheck: Recheck) -> list[Problem]:
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


def suggest(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest `choices`, else the list of valid ones."""
    options = sorted(choices)
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.6)
    if close:
        return " (did you mean " + " or ".join(close) + "?)"
    return f" (valid keys: {', '.join(options)})" if options else ""
