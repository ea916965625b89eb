"""The ecosystem's flat argument names, accepted as aliases of flashcp's dotted keys.

People arriving from Hugging Face `TrainingArguments`, PaddleFormers, TRL or LLaMA-Factory
write `max_steps`, `learning_rate`, `per_device_train_batch_size`, ... Where flashcp has the
same knob, the flat name is accepted as a TOP-LEVEL key, in the YAML file (`max_steps: 100`
next to the sections) or as an override (`max_steps=100`), and means exactly the dotted key
(`train.steps`). Aliases are not accepted inside sections (`train.max_steps` is an unknown key,
with a suggestion), so each knob has one canonical place and `config.yaml` of a run is written
with the canonical keys only.

Giving an alias and its key in the same layer — both in the file, or both on the command line
— is an error naming both. Across layers the command line wins as for any key: a file with
`train.steps: 60` run with `max_steps=10` trains 10 steps.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from flashcp.config.overrides import Override
from flashcp.problems import Problem, with_note

ALIASES: dict[str, str] = {
    "max_steps": "train.steps",
    "learning_rate": "train.lr",
    "per_device_train_batch_size": "data.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "max_grad_norm": "train.grad_clip",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep_last",
}
"""Alias (top-level key) → the flashcp key it sets."""


def _has(raw: MutableMapping[str, Any], dotted: str) -> bool:
    section, _, key = dotted.partition(".")
    values = raw.get(section)
    return isinstance(values, MutableMapping) and key in values


def resolve_file_aliases(raw: MutableMapping[str, Any]) -> tuple[dict[str, str], list[Problem]]:
    """Move top-level aliases of a config mapping (in place) to their dotted keys.

    Returns `({dotted key: alias}, errors)`: the keys that were set through an alias (so later
    messages about them can say so) and one error per alias whose key is also given.
    """
    used: dict[str, str] = {}
    errors: list[Problem] = []
    for alias, dotted in ALIASES.items():
        if alias not in raw:
            continue
        value = raw.pop(alias)
        if _has(raw, dotted):
            errors.append(
                Problem(
                    alias,
                    f"is an alias of {dotted}, which is also set: keep one of {alias} and {dotted}",
                )
            )
            continue
        section, _, key = dotted.partition(".")
        target = raw.get(section)
        if not isinstance(target, MutableMapping):
            if target is not None:
                continue  # the section itself is malformed: reported when it is built
            target = raw[section] = {}
        target[key] = value
        used[dotted] = alias
    return used, errors


def resolve_override_aliases(
    overrides: Sequence[Override],
) -> tuple[list[Override], list[Problem]]:
    """The overrides with every alias (`max_steps=10`) rewritten to its key (`train.steps=10`,
    the text kept as given); an error when an alias and its key are both given."""
    given = {o.key for o in overrides}
    out: list[Override] = []
    errors: list[Problem] = []
    for ov in overrides:
        dotted = ALIASES.get(ov.key)
        if dotted is None:
            out.append(ov)
        elif dotted in given:
            errors.append(
                Problem(
                    ov.key,
                    f"is an alias of {dotted}, which is also set on the command line: keep "
                    f"one of {ov.key} and {dotted}",
                )
            )
        else:
            out.append(Override(key=dotted, value=ov.value, text=ov.text))
    return out, errors


def mark_aliases(errors: Sequence[Problem], used: dict[str, str]) -> list[Problem]:
    """Errors about a key that the file set through an alias say so (`[given as max_steps]`)."""
    out = []
    for err in errors:
        alias = used.get(err.key)
        if alias is not None:
            err = with_note(err, f" [given as {alias}]")
        out.append(err)
    return out


def explain_misplaced(errors: Sequence[Problem]) -> list[Problem]:
    """An alias written inside a section (`train.max_steps`) is an unknown key there; say
    where it is accepted instead."""
    out = []
    for err in errors:
        name = err.key.rpartition(".")[2]
        dotted = ALIASES.get(name)
        if "." in err.key and dotted is not None and err.message.startswith("unknown key"):
            err = Problem(
                err.key,
                f"unknown key: {name} is an alias of {dotted}, accepted at the top level of the "
                f"file or as the override {name}=VALUE, not inside a section: write {dotted} "
                f"(or a top-level {name})",
            )
        out.append(err)
    return out
