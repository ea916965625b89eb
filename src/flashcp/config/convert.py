"""YAML values → typed config fields: the type rules and the section builder.

Ints must be ints (not bools), floats accept ints (and YAML 1.1 strings such as `1e-4`, which
PyYAML reads as text), `Literal` fields list their choices, `X | None` fields accept null,
`list[X]` / `tuple[X, ...]` fields take lists. `build_section` turns one mapping into one
section's dataclass, appending every problem (unknown key, wrong type, missing key) to a list
with its dotted key; `section_dict` is the way back.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from flashcp.config.errors import suggest
from flashcp.config.schema import config_key
from flashcp.problems import Problem

_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def describe(tp: Any) -> str:
    """How an expected type reads in an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is list or origin is tuple:
        (item, *_) = typing.get_args(tp) or (Any,)
        return f"a list of {describe(item).removeprefix('a ').removeprefix('an ')}s"
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
    }
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def convert(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted value) for `value` against the annotation `tp`.

    Handles what config fields use: Literal, unions (incl. `X | None`), `list[X]`, bool, int,
    float, str; any other annotation is accepted as is.
    """
    origin = typing.get_origin(tp)
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = convert(value, arg)
            if ok:
                return True, out
        return False, value
    if tp is type(None):
        return value is None, value
    if origin is list or origin is tuple:  # tuple[X, ...]: a list in YAML, kept as a tuple
        (item, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            return False, value
        items = [convert(v, item) for v in value]
        converted = [v for _, v in items]
        return all(ok for ok, _ in items), tuple(converted) if origin is tuple else converted
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return True, value


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), f"a {type(value).__name__}"
    )


def build_section(
    cls: type,
    raw: Any,
    prefix: str,
    errors: list[Problem],
    *,
    base: Mapping[str, Any] | None = None,
    ignore: Iterable[str] = (),
) -> Any:
    """An instance of dataclass `cls` from the mapping `raw`, appending problems to `errors`.

    Unknown keys are errors with close-match suggestions; a field with a bad value keeps its
    default (so later checks still run); `base` gives starting values (a preset). Returns None
    when a required field is missing or bad.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        errors.append(Problem(prefix, f"must be a mapping of keys to values, got {type_name(raw)}"))
        raw = {}
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}  # by YAML key
    skip = set(ignore)
    for key in raw:
        if key not in fields and key not in skip:
            errors.append(Problem(f"{prefix}.{key}", "unknown key" + suggest(str(key), fields)))
    values: dict[str, Any] = dict(base or {})
    complete = True
    for key, f in fields.items():
        name = f.name
        if key in raw:
            ok, value = convert(raw[key], hints.get(name, Any))
            if ok:
                values[name] = value
                continue
            errors.append(
                Problem(
                    f"{prefix}.{key}",
                    f"expected {describe(hints.get(name, Any))}, got {raw[key]!r} "
                    f"({type_name(raw[key])})",
                )
            )
        if name in values:
            continue
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        if not has_default:
            complete = False
            if key not in raw:
                errors.append(Problem(f"{prefix}.{key}", "required key is missing"))
    if not complete:
        return None
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        errors.append(Problem(prefix, str(exc)))
        return None


def section_dict(obj: Any) -> dict[str, Any]:
    """A section dataclass as its YAML mapping (by YAML key)."""
    return {config_key(f): getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
