"""YAML → typed `Config`, collecting every problem (unknown keys, wrong types, bad values).

    cfg = load_config("configs/gpt/tiny_cp2.yaml", ["train.steps=3"], world_size=2)

raises `ConfigValidationError` listing all problems, each with its dotted key and the fix.
Type rules: ints must be ints (not bools), floats accept ints (and YAML 1.1 strings such as
`1e-4`, which PyYAML reads as text), `Literal` fields list their choices, `X | None` fields
accept null. The `model` section is `flashcp.models.ModelArgs`: either every field, or
`preset: <name>` or `from_pretrained: <HF model directory>` plus the fields to change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import types
import typing
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from flashcp.config.aliases import (
    explain_misplaced,
    mark_aliases,
    resolve_file_aliases,
    resolve_override_aliases,
)
from flashcp.config.errors import (
    ConfigError,
    ConfigValidationError,
    as_fix,
    prune_fixes,
    suggest,
    with_note,
)
from flashcp.config.overrides import Override, apply_overrides, parse_overrides
from flashcp.config.placeholders import find_placeholders, is_placeholder, placeholder_message
from flashcp.config.recipe_spec import RECIPES, extra_sections
from flashcp.config.schema import SECTIONS, Config, config_key

"""A `model.from_pretrained` directory holds one of these."""
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
    if origin is list or origin is tuple:
        (item, *_) = typing.get_args(tp) or (Any,)
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
    if origin is list or origin is tuple:  # tuple[X, ...]: a list in YAML, kept as a tuple
        (item, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            return False, value
        items = [_convert(v, item) for v in value]
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
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}  # by YAML key
    skip = set(ignore)
    for key in raw:
        if key not in fields and key not in skip:
            errors.append(ConfigError(f"{prefix}.{key}", "unknown key" + suggest(str(key), fields)))
    values: dict[str, Any] = dict(base or {})
    complete = True
    for key, f in fields.items():
        name = f.name
        if key in raw:
            ok, value = _convert(raw[key], hints.get(name, Any))
            if ok:
                values[name] = value
                continue
            errors.append(
                ConfigError(
                    f"{prefix}.{key}",
                    f"expected {_describe(hints.get(name, Any))}, got {raw[key]!r} "
                    f"({_type_name(raw[key])})",
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
                errors.append(ConfigError(f"{prefix}.{key}", "required key is missing"))
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


def build_model_args(
    raw: Any, errors: list[ConfigError], *, given: Collection[str] = ()
) -> tuple[Any, str | None]:
    """`(ModelArgs | None, preset name | None)` from the `model` section.

    The section starts from `preset: <name>` or `from_pretrained: <HF directory>` (its
    `config.json`, `flashcp.models.hf_config`), plus the fields to change. A key that
    contradicts that config.json is refused naming both values; one that equals it is fine
    (only the training-side fields, `flashcp.models.hf_config.TRAINING_FIELDS`, may be set
    freely). `given`: the keys set on the command line (the refusal of a preset with a
    directory names the override that resolves it)."""
    ModelArgs, presets = _model_api()
    if raw is None:
        errors.append(
            ConfigError(
                "model",
                "required section is missing: give model.preset (one of "
                f"{', '.join(sorted(presets))}), model.from_pretrained (a Hugging Face model "
                "directory) and/or every ModelArgs field",
            )
        )
        return None, None
    base = None
    preset = raw.get("preset") if isinstance(raw, Mapping) else None
    pretrained = raw.get("from_pretrained") if isinstance(raw, Mapping) else None
    if preset is not None and pretrained is not None:
        fix = "remove one of them"
        if "model.preset" in given and "model.from_pretrained" not in given:
            fix = ("add model.from_pretrained=null to build the preset instead (the file's "
                   "other model keys then change the preset)")  # fmt: skip
        errors.append(
            ConfigError(
                "model.preset",
                f"{preset!r} cannot be combined with model.from_pretrained {pretrained!r} (its "
                f"config.json defines the model): {fix}",
            )
        )
        return None, None
    if pretrained is not None:
        # `model.X=null` removes a restated key (config.json gives it), whatever X's type
        raw = {k: v for k, v in raw.items() if v is not None or k in ("preset", "from_pretrained")}
        base = _pretrained_values(raw, errors)
        if base is None:
            return None, None
    elif preset is not None:
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
    args = build_section(
        ModelArgs, raw, "model", errors, base=base, ignore=("preset", "from_pretrained")
    )
    return args, preset


def _pretrained_values(raw: Mapping[str, Any], errors: list[ConfigError]) -> dict[str, Any] | None:
    """ModelArgs values from `model.from_pretrained`'s config.json (None after an error): the
    directory must hold a config.json flashcp builds exactly and safetensors weights, and no
    other key of the section may contradict it."""
    from flashcp.models.hf_config import (
        FIELD_KEYS,
        TRAINING_FIELDS,
        HFConfigError,
        mtp_refusal,
        parse_hf_config,
        read_config_json,
    )
    from flashcp.models.weight_files import WEIGHT_FILES

    ModelArgs, _ = _model_api()
    path = raw["from_pretrained"]
    key = "model.from_pretrained"
    if not isinstance(path, str) or not path.strip():
        errors.append(ConfigError(key, f"expected a directory path, got {path!r}"))
        return None
    directory = Path(path)
    if not directory.is_dir():
        errors.append(
            ConfigError(key, f"no directory at {path!r}: give a Hugging Face model directory "
                             "(config.json, model.safetensors[.index.json], tokenizer files)")
        )  # fmt: skip
        return None
    try:
        config, source = read_config_json(directory)
        values, _notes = parse_hf_config(config, source)
    except HFConfigError as exc:
        for hf_key, message in exc.problems:
            errors.append(ConfigError(key, f"{exc.source}: {hf_key}: {message}"))
        return None
    except (OSError, ValueError) as exc:
        errors.append(ConfigError(key, str(exc)))
        return None
    if not any((directory / f).is_file() for f in WEIGHT_FILES):
        errors.append(
            ConfigError(key, f"{path} has no {' or '.join(WEIGHT_FILES)}: the weights are "
                             "missing (download them, or point at the complete directory)")
        )  # fmt: skip
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs)}
    hints = typing.get_type_hints(ModelArgs)
    ok = True
    for name, value in raw.items():
        if name in ("preset", "from_pretrained") or name in TRAINING_FIELDS:
            continue
        if name not in defaults:
            continue  # build_section reports unknown keys
        good, given = _convert(value, hints.get(name, Any))
        want = values.get(name, defaults[name])
        if good and given != want:
            hf_key = FIELD_KEYS.get(name, name)
            shown = config.get(hf_key, want) if hf_key != "architectures" else want
            if hf_key == "architectures":
                problem = (
                    f"{value!r} contradicts config.json architectures "
                    f"{config.get('architectures')!r} in {path} (which gives {want!r}); "
                    "config.json defines the model"
                )
            else:
                problem = (
                    f"{value!r} contradicts config.json {hf_key} {shown!r} in {path}; "
                    "config.json defines the model"
                )
            errors.append(ConfigError(
                f"model.{name}", problem, fixes=(as_fix({f"model.{name}": None}),),
                other=f"remove model.{name} from the file",
            ))  # fmt: skip
            ok = False
    declared = values.get("mtp_layers", 0)
    asked = raw.get("mtp_layers", declared)
    if _convert(asked, int)[0]:  # a bad value is build_section's to report
        try:
            refusal = mtp_refusal(directory, values["num_layers"], declared, asked)
        except (OSError, ValueError) as exc:
            refusal = str(exc)
        if refusal is not None:
            errors.append(ConfigError("model.mtp_layers", refusal))
            ok = False
    return values if ok else None


def _section_dict(obj: Any) -> dict[str, Any]:
    return {config_key(f): getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


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
            err = with_note(err, f" [set on the command line: {hit.text}]")
        out.append(err)
    return out


def build_config(
    raw: Mapping[str, Any],
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    nnodes: int = 1,
    check: bool = True,
    allow_placeholders: bool = False,
) -> Config:
    """A validated `Config` from a raw mapping plus `key=value` overrides.

    Raises `ConfigValidationError` with every problem: parse errors of the overrides, unknown
    sections or keys, wrong types, placeholders still to fill in (`/path/to/...`,
    `flashcp.config.placeholders`; unless `allow_placeholders`), and (when `check`) the
    cross-field checks of `flashcp.config.validate.check_config` (for `world_size` processes
    on `nnodes` nodes). Top-level aliases (`max_steps`, ...; `flashcp.config.aliases`) are
    accepted in `raw` and in `overrides`.
    """
    cfg, errors = collect(raw, source=source, overrides=overrides, world_size=world_size,
                          nnodes=nnodes, check=check,
                          allow_placeholders=allow_placeholders)  # fmt: skip
    if errors or cfg is None:
        raise ConfigValidationError(errors, source)
    return cfg


def collect(
    raw: Mapping[str, Any],
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    nnodes: int = 1,
    check: bool = True,
    allow_placeholders: bool = False,
    validate_fixes: bool = True,
) -> tuple[Config | None, list[ConfigError]]:
    """`(config or None, every problem)` without raising: what `flashcp validate` reports.

    A placeholder path (`/path/to/...`, `flashcp.config.placeholders`) is a problem naming its
    key and what to put there, unless `allow_placeholders` (`flashcp validate`'s static check
    of a shipped recipe): then it is accepted unchecked, and a placeholder
    `model.from_pretrained` leaves the model to the section's other keys. With
    `validate_fixes`, each problem keeps only the fixes that pass this same check once applied
    (`flashcp.config.errors.prune_fixes`)."""

    def finish(errors: list[ConfigError]) -> list[ConfigError]:
        errors = _mark_overrides(mark_aliases(errors, aliased), parsed)
        if not validate_fixes or not any(e.fixes for e in errors):
            return errors
        return prune_fixes(errors, lambda extra: collect(
            raw, source=source, overrides=[*overrides, *extra], world_size=world_size,
            nnodes=nnodes, check=check, allow_placeholders=allow_placeholders,
            validate_fixes=False,
        )[1])  # fmt: skip

    data: dict[str, Any] = json.loads(json.dumps(dict(raw), default=str))  # deep copy
    aliased, errors = resolve_file_aliases(data)
    parsed, bad = parse_overrides(overrides)
    parsed, alias_errors = resolve_override_aliases(parsed)
    errors += bad + alias_errors
    errors += apply_overrides(data, parsed)
    errors += _steps_or_epochs(data, {ov.key for ov in parsed})
    for ov in parsed:  # the command line replaced what the file gave through an alias
        aliased.pop(ov.key, None)
    extras = extra_sections()
    removed, problems = _remove_null_sections(data, parsed, extras)
    errors += problems
    notes = _command_line_model(data, parsed)
    known = ["model", *SECTIONS, *extras]
    for key in data:
        if key not in known:
            errors.append(ConfigError(str(key), "unknown section" + suggest(str(key), known)))
    placeholders = find_placeholders(data)
    if not allow_placeholders:
        errors += [ConfigError(k, placeholder_message(k, v, data)) for k, v in placeholders]
    pretrained = _pretrained_path(data)
    unfilled = is_placeholder(pretrained)
    if unfilled:  # the model section's own keys give the model; nothing to read or load
        data["model"] = {k: v for k, v in data["model"].items() if k != "from_pretrained"}
    if pretrained is not None:
        section = data.get("data")
        if section is None:
            section = data["data"] = {}
        if isinstance(section, dict) and "tokenizer" not in section:
            section["tokenizer"] = pretrained  # the model directory's tokenizer by default
    model, preset = build_model_args(data.get("model"), errors, given={o.key for o in parsed})
    sections = {
        name: build_section(cls, data.get(name), name, errors) for name, cls in SECTIONS.items()
    }
    extra_values = {
        name: build_section(cls, data.get(name), name, errors)
        for name, cls in extras.items()
        if name in data
    }
    errors = explain_misplaced(errors)
    if model is None or any(v is None for v in sections.values()):
        return None, finish(errors)
    if pretrained is not None and not unfilled:
        _pretrained_weights(sections["checkpoint"], pretrained, errors)
    cfg = Config(
        model=model,
        model_preset=preset,
        model_from_pretrained=pretrained,
        extras=extra_values,
        source=source,
        overrides=tuple(overrides),
        notes=tuple(notes),
        **sections,
    )
    spec = RECIPES.get(cfg.run.recipe)
    for name in sorted(removed & set(spec.settings if spec else ())):
        errors.append(
            ConfigError(
                name,
                f"{name}=null cannot remove the {name} section: run.recipe {cfg.run.recipe} "
                f"reads it with or without it, so it would silently fall back to its defaults; "
                f"set the {name}.* keys you want instead, or another run.recipe",
            )
        )
    if check:
        from flashcp.config.validate import check_config

        failed = {e.key for e in errors} | {k for k, _ in placeholders}
        if unfilled and cfg.data.tokenizer == pretrained:
            failed.add("data.tokenizer")  # the placeholder directory's tokenizer
        errors += check_config(cfg, world_size=world_size, nnodes=nnodes, skip=failed)
    return cfg, finish(errors)


def _remove_null_sections(
    data: dict[str, Any], overrides: Sequence[Override], extras: Mapping[str, type]
) -> tuple[set[str], list[ConfigError]]:
    """`SECTION=null` on the command line removes an optional section (a recipe's, e.g.
    `lora=null`: no adapters) and is refused for a core one, which has no "absent" (its keys
    would silently fall back to their defaults). Returns the removed names and the refusals;
    an unknown name is left to the unknown-section check."""
    removed: set[str] = set()
    errors: list[ConfigError] = []
    for ov in overrides:
        name = ov.key
        if len(ov.parts) != 1 or ov.value is not None or data.get(name) is not None:
            continue  # not a section=null, or a later override gave the section keys again
        if name in extras:
            data.pop(name, None)
            removed.add(name)
        elif name in SECTIONS:  # (model=null: "required section is missing")
            errors.append(
                ConfigError(
                    name,
                    f"{name}=null: the {name} section is not optional and cannot be removed "
                    f"(null would silently reset every {name}.* key to its default): set the "
                    f"{name}.* keys you want to change instead",
                )
            )
    return removed, errors


def _command_line_model(data: dict[str, Any], overrides: Sequence[Override]) -> list[str]:
    """A `model.from_pretrained=DIR` given on the command line replaces the file's
    `model.preset` (the command line wins over the file); the note says so."""
    given = {o.key for o in overrides}
    model = data.get("model")
    if (
        "model.from_pretrained" not in given
        or "model.preset" in given
        or not isinstance(model, dict)
        or model.get("from_pretrained") is None
        or model.get("preset") is None
    ):
        return []
    preset = model.pop("preset")
    return [
        f"model.from_pretrained={model['from_pretrained']} on the command line replaces the "
        f"file's model.preset {preset!r}: the model is the directory's (its config.json)"
    ]


def _steps_or_epochs(data: dict[str, Any], command_line: set[str]) -> list[ConfigError]:
    """`train.steps` and `train.epochs` are alternatives: given in the same place (both in
    the file, or both on the command line) they are refused; one in the file and the other on
    the command line, the command line's wins (as for any key) and the file's is dropped."""
    train = data.get("train")
    if not isinstance(train, dict) or train.get("steps") is None or train.get("epochs") is None:
        return []
    typed = [key for key in ("train.steps", "train.epochs") if key in command_line]
    if len(typed) == 1:
        train.pop("epochs" if typed[0] == "train.steps" else "steps")
        return []
    where = "on the command line" if typed else "in the file"
    return [
        ConfigError(
            "train.epochs",
            f"train.steps ({train['steps']}) and train.epochs ({train['epochs']}) are both set "
            f"{where}: set exactly one (train.epochs counts the steps from the data's size at "
            "the start)",
        )
    ]


def _pretrained_path(data: Mapping[str, Any]) -> str | None:
    model = data.get("model")
    path = model.get("from_pretrained") if isinstance(model, Mapping) else None
    return path if isinstance(path, str) else None


def _pretrained_weights(checkpoint: Any, pretrained: str, errors: list[ConfigError]) -> None:
    """`model.from_pretrained` implies `checkpoint.init_from` (the same directory's weights); a
    different `init_from` contradicts it. A resumed run restores its own checkpoint either way."""
    if checkpoint.init_from is None:
        checkpoint.init_from = pretrained
    elif Path(checkpoint.init_from).resolve() != Path(pretrained).resolve():
        errors.append(
            ConfigError(
                "checkpoint.init_from",
                f"{checkpoint.init_from!r} contradicts model.from_pretrained {pretrained!r}, "
                "which loads that directory's weights: remove checkpoint.init_from (or "
                "model.from_pretrained, and give the model section yourself)",
            )
        )


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
    nnodes: int = 1,
    check: bool = True,
    allow_placeholders: bool = False,
) -> Config:
    """Read, override, type-check and validate the YAML config at `path` (see `build_config`)."""
    return build_config(
        read_yaml(path),
        source=str(path),
        overrides=overrides,
        world_size=world_size,
        nnodes=nnodes,
        check=check,
        allow_placeholders=allow_placeholders,
    )


# ---------------------------------------------------------------------------------------------
# Back to plain data


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (the `model` section with every field, no preset;
    with `train.epochs` no `train.steps`, which the epochs give at the start)."""
    model = _section_dict(cfg.model)
    if cfg.model_from_pretrained is not None:
        model = {"from_pretrained": cfg.model_from_pretrained, **model}
    out: dict[str, Any] = {"model": model}
    for name in SECTIONS:
        out[name] = _section_dict(getattr(cfg, name))
    if cfg.train.epochs is not None:
        out["train"].pop("steps", None)
    for name, value in cfg.extras.items():
        out[name] = _section_dict(value)
    return json.loads(json.dumps(out, default=list))


def to_yaml(cfg: Config) -> str:
    """`to_dict` as YAML, in section order (reloadable with `build_config`)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


HASH_EXCLUDE: tuple[str, ...] = (
    "model.from_pretrained",
    "run",
    "checkpoint",
    "hardware",
    "debug",
    "eval",
    "hardware",
    "train.steps",
    "train.epochs",
    "train.log_every",
    "train.offload_activations",
    "parallel.shard_gradients",
    "attention.fa4_unavailable",
)
"""Keys that do not change what a step computes, left out of `config_hash` (a resumed run may
change them). Activation offload moves kept tensors to the host and back unchanged;
`parallel.shard_gradients` changes only when the gradients are reduce-scattered and writes the
same checkpoints as ZeRO-1; `attention.fa4_unavailable` only decides whether an unavailable
FlashAttention version is refused or replaced (a run that trained under one policy computed
what it would have under the other)."""

EARLIER_VALUES: dict[str, Any] = {"data.balance": "none"}
"""Keys added after checkpoints were written whose default is not what earlier runs computed,
with the value they computed with (`data.balance`: their packing was first-fit). Every other
added key's default keeps the earlier behaviour (`config_changes`)."""


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


def config_changes(saved: Mapping[str, Any], cfg: Config) -> list[str]:
    """Dotted keys whose values differ between a checkpoint's saved config (its `hashed_dict`)
    and `cfg`. A key the saved config lacks was added since: the flashcp that saved it computed
    what the key's earlier value does (`EARLIER_VALUES`, else the key's default), so `cfg`
    holding that value is no change, and any other value is one."""
    current = hashed_dict(cfg)
    return [
        key
        for key in diff_dicts(saved, current)
        if not (
            _lookup(saved, key) is _MISSING
            and _lookup(current, key) == _earlier_value(cfg, key)
        )
        and not _excluded(key)  # hashed by a flashcp that still counted it
    ]


def _excluded(dotted: str) -> bool:
    """Whether the dotted key is (inside) a `HASH_EXCLUDE` entry."""
    return any(dotted == key or dotted.startswith(key + ".") for key in HASH_EXCLUDE)


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return _MISSING
        data = data[part]
    return data


def _earlier_value(cfg: Config, dotted: str) -> Any:
    """What runs from before the `section.field` key `dotted` computed with, as plain data:
    its `EARLIER_VALUES` entry, else the field's default (`_MISSING` if it has none)."""
    if dotted in EARLIER_VALUES:
        return EARLIER_VALUES[dotted]
    section, _, name = dotted.partition(".")
    obj = cfg.extras.get(section) if section in cfg.extras else getattr(cfg, section, None)
    if not name or not dataclasses.is_dataclass(obj):
        return _MISSING
    for f in dataclasses.fields(obj):
        if config_key(f) == name:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                return _MISSING
            return json.loads(json.dumps(default, default=list))
    return _MISSING


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
