"""Command-line overrides: `key.sub=value`, values parsed with YAML scalar rules.

`train.steps=3` sets an int, `data.path=null` sets None, `parallel.pad=true` a bool,
`run.output_dir=runs/x` a string, `train.lr=1e-4` a float (the loader accepts YAML 1.1's
quirk of reading `1e-4` as a string for float fields), `parallel.pp_layers=[3,2]` a flat list.
Overrides are applied to the raw YAML mapping *before* it is type-checked, so an override gets
exactly the same checks (unknown keys with suggestions, expected types) as the file; errors on
an overridden key say so.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import yaml

from flashcp.problems import Problem


@dataclass(frozen=True)
class Override:
    """One parsed `key.sub=value` argument."""

    key: str
    """Dotted key, e.g. `train.steps`."""
    value: Any
    """The value after YAML scalar parsing."""
    text: str
    """The argument as given, for messages."""

    @property
    def parts(self) -> list[str]:
        return self.key.split(".")


def parse_override(text: str) -> Override:
    """Parse one `key.sub=value`; `ValueError` with the accepted form when malformed."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(
            f"override {text!r} is not of the form key.sub=value (e.g. train.steps=10)"
        )
    parts = key.split(".")
    if any(not p or not p.replace("_", "").isalnum() for p in parts):
        raise ValueError(
            f"override key {key!r} must be dotted identifiers (e.g. train.steps), got {text!r}"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"override {text!r}: the value is not a YAML scalar ({exc})") from None
    if isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)
    ):
        raise ValueError(
            f"override {text!r}: give one key per scalar value (e.g. {key}.field=1) or a flat "
            "list of scalars (parallel.pp_layers=[3,2]), not a YAML mapping or nested list"
        )
    return Override(key=key, value=value, text=text)


def parse_overrides(texts: Iterable[str]) -> tuple[list[Override], list[Problem]]:
    """Parse every override, collecting one error per malformed argument."""
    out: list[Override] = []
    errors: list[Problem] = []
    for text in texts:
        try:
            out.append(parse_override(text))
        except ValueError as exc:
            errors.append(Problem(text.partition("=")[0].strip() or text, str(exc)))
    return out, errors


def apply_overrides(raw: MutableMapping[str, Any], overrides: Iterable[Override]) -> list[Problem]:
    """Set each override in the nested mapping `raw` (in place), creating sections as needed.

    Returns errors for overrides that would descend into a scalar (e.g. `train.steps.x=1`).
    """
    errors: list[Problem] = []
    for ov in overrides:
        node: MutableMapping[str, Any] = raw
        parts = ov.parts
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, MutableMapping):
                where = ".".join(parts[: depth + 1])
                errors.append(
                    Problem(
                        ov.key,
                        f"cannot set {ov.key}: {where} is a {type(child).__name__}, not a "
                        "section (check the key)",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = ov.value
    return errors
