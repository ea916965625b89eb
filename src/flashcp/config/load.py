"""YAML → typed `Config`, collecting every problem (unknown keys, wrong types, bad values).

    cfg = load_config("configs/gpt/tiny_cp2.yaml", ["train.steps=3"], world_size=2)

raises `ConfigValidationError` listing all problems, each with its dotted key and the fix.
Type rules: ints must be ints (not bools), floats accept ints (and YAML 1.1 strings such as
`1e-4`, which PyYAML reads as text), `Literal` fields list their choices, `X | None` fields
accept null. The `model` section is `flashcp.models.ModelArgs`: either every field, or
`preset: <name>` plus the fields to change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from flashcp.config.errors import ConfigError, ConfigValidationError, suggest
from flashcp.config.overrides import Override, apply_overrides, parse_overrides
from flashcp.config.schema import SECTIONS, Config, extra_sections

_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_MISSING = object()


# ---------------------------------------------------------------------------------------------
# Types


def _describe(tp: Any) -> str:
    """How an expected type reads in an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"a list of {_describe(item).removeprefix('a ').removeprefix('an ')}s"
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
    }
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted value) for `value` against the annotation `tp`.

    Handles what config fields use: Literal, unions (incl. `X | None`), `list[X]`, bool, int,
    float, str; any other annotation is accepted as is.
    """
    origin = typing.get_origin(tp)
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _convert(value, arg)
            if ok:
                return True, out
        return False, value
    if tp is type(None):
        return value is None, value
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            return False, value
        items = [_convert(v, item) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
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


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), f"a {type(value).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# Sections


def build_section(
    cls: type,
    raw: Any,
    prefix: str,
    errors: list[ConfigError],
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
        errors.append(
            ConfigError(prefix, f"must be a mapping of keys to values, got {_type_name(raw)}")
        )
        raw = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    skip = set(ignore)
    for key in raw:
        if key not in fields and key not in skip:
            errors.append(ConfigError(f"{prefix}.{key}", "unknown key" + suggest(str(key), fields)))
    values: dict[str, Any] = dict(base or {})
    complete = True
    for name, f in fields.items():
        if name in raw:
            ok, value = _convert(raw[name], hints.get(name, Any))
            if ok:
                values[name] = value
                continue
            errors.append(
                ConfigError(
                    f"{prefix}.{name}",
                    f"expected {_describe(hints.get(name, Any))}, got {raw[name]!r} "
                    f"({_type_name(raw[name])})",
                )
            )
        if name in values:
            continue
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        if not has_default:
            complete = False
            if name not in raw:
                errors.append(ConfigError(f"{prefix}.{name}", "required key is missing"))
    if not complete:
        return None
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        errors.append(ConfigError(prefix, str(exc)))
        return None


def _model_api() -> tuple[type, dict[str, Any]]:
    """`(ModelArgs, {preset name: ModelArgs})` from `flashcp.models` (imported lazily)."""
    from flashcp.models import PRESETS, ModelArgs

    return ModelArgs, {name: getattr(p, "args", p) for name, p in PRESETS.items()}


def build_model_args(raw: Any, errors: list[ConfigError]) -> tuple[Any, str | None]:
    """`(ModelArgs | None, preset name | None)` from the `model` section."""
    ModelArgs, presets = _model_api()
    if raw is None:
        errors.append(
            ConfigError(
                "model",
                "required section is missing: give model.preset (one of "
                f"{', '.join(sorted(presets))}) and/or every ModelArgs field",
            )
        )
        return None, None
    base = None
    preset = raw.get("preset") if isinstance(raw, Mapping) else None
    if preset is not None:
        if not isinstance(preset, str) or preset not in presets:
            errors.append(
                ConfigError(
                    "model.preset",
                    f"unknown preset {preset!r}"
                    + suggest(str(preset), presets).replace("valid keys", "presets"),
                )
            )
            preset = None
        else:
            base = _section_dict(presets[preset])
    args = build_section(ModelArgs, raw, "model", errors, base=base, ignore=("preset",))
    return args, preset


def _section_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


# ---------------------------------------------------------------------------------------------
# Whole configs


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML file; `ConfigValidationError` when unreadable or not a mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigValidationError(
            [ConfigError("<file>", f"cannot read {p}: {exc.strerror or exc}")], str(p)
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigValidationError(
            [ConfigError("<file>", f"not valid YAML: {exc}")], str(p)
        ) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigValidationError(
            [ConfigError("<file>", f"the top level must be a mapping of sections, got "
                                   f"{_type_name(raw)}")],
            str(p),
        )  # fmt: skip
    return raw


def _mark_overrides(errors: list[ConfigError], overrides: Sequence[Override]) -> list[ConfigError]:
    out = []
    for err in errors:
        hits = [o for o in overrides if err.key == o.key or err.key.startswith(o.key + ".")]
        hit = max(hits, key=lambda o: len(o.key)) if hits else None
        if hit is not None:
            err = ConfigError(err.key, f"{err.message} [set on the command line: {hit.text}]")
        out.append(err)
    return out


def build_config(
    raw: Mapping[str, Any],
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    check: bool = True,
) -> Config:
    """A validated `Config` from a raw mapping plus `key=value` overrides.

    Raises `ConfigValidationError` with every problem: parse errors of the overrides, unknown
    sections or keys, wrong types, and (when `check`) the cross-field checks of
    `flashcp.config.validate.check_config` (for `world_size`, when given).
    """
    cfg, errors = collect(raw, source=source, overrides=overrides, world_size=world_size,
                          check=check)  # fmt: skip
    if errors or cfg is None:
        raise ConfigValidationError(errors, source)
    return cfg


def collect(
    raw: Mapping[str, Any],
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    check: bool = True,
) -> tuple[Config | None, list[ConfigError]]:
    """`(config or None, every problem)` without raising: what `flashcp validate` reports."""
    data: dict[str, Any] = json.loads(json.dumps(dict(raw), default=str))  # deep copy
    parsed, errors = parse_overrides(overrides)
    errors += apply_overrides(data, parsed)
    extras = extra_sections()
    known = ["model", *SECTIONS, *extras]
    for key in data:
        if key not in known:
            errors.append(ConfigError(str(key), "unknown section" + suggest(str(key), known)))
    model, preset = build_model_args(data.get("model"), errors)
    sections = {
        name: build_section(cls, data.get(name), name, errors) for name, cls in SECTIONS.items()
    }
    extra_values = {
        name: build_section(cls, data.get(name), name, errors)
        for name, cls in extras.items()
        if name in data
    }
    if model is None or any(v is None for v in sections.values()):
        return None, _mark_overrides(errors, parsed)
    cfg = Config(
        model=model,
        model_preset=preset,
        extras=extra_values,
        source=source,
        overrides=tuple(overrides),
        **sections,
    )
    if check:
        from flashcp.config.validate import check_config

        bad = {e.key for e in errors}
        errors += check_config(cfg, world_size=world_size, skip=bad)
    return cfg, _mark_overrides(errors, parsed)


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
    check: bool = True,
) -> Config:
    """Read, override, type-check and validate the YAML config at `path` (see `build_config`)."""
    return build_config(
        read_yaml(path), source=str(path), overrides=overrides, world_size=world_size, check=check
    )


# ---------------------------------------------------------------------------------------------
# Back to plain data


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (the `model` section with every field, no preset)."""
    out: dict[str, Any] = {"model": _section_dict(cfg.model)}
    for name in SECTIONS:
        out[name] = _section_dict(getattr(cfg, name))
    for name, value in cfg.extras.items():
        out[name] = _section_dict(value)
    return json.loads(json.dumps(out, default=list))


def to_yaml(cfg: Config) -> str:
    """`to_dict` as YAML, in section order (reloadable with `build_config`)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


HASH_EXCLUDE: tuple[str, ...] = (
    "run",
    "checkpoint",
    "hardware",
    "debug",
    "train.steps",
    "train.log_every",
)
"""Keys that do not change what a step computes, left out of `config_hash` (a resumed run may
change them)."""


def hashed_dict(cfg: Config) -> dict[str, Any]:
    """`to_dict` without the `HASH_EXCLUDE` keys: the part of the config a checkpoint binds."""
    data = to_dict(cfg)
    for key in HASH_EXCLUDE:
        section, _, name = key.partition(".")
        if name:
            data.get(section, {}).pop(name, None)
        else:
            data.pop(section, None)
    return data


def config_hash(cfg: Config) -> str:
    """sha256 of the canonical JSON of `hashed_dict(cfg)` (16 hex digits)."""
    blob = json.dumps(hashed_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def diff_dicts(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        dotted = f"{prefix}{key}"
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += diff_dicts(va, vb, dotted + ".")
        elif va != vb:
            out.append(dotted)
    return out
