"""YAML → typed `Config`, collecting every problem (unknown keys, wrong types, bad values).

    cfg = load_config("configs/gpt/tiny_cp2.yaml", ["train.steps=3"], world_size=2)

raises `ProblemsError` listing all problems, each with its dotted key and the fix.
The type rules are `flashcp.config.convert`'s; the `model` section (a preset, a Hugging Face
model directory, or every field) is `flashcp.config.model_section`'s; the cross-field rules
are `flashcp.config.validate.check_config`'s. A config saved and hashed is
`flashcp.config.saved`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from flashcp.config.aliases import (
    explain_misplaced,
    mark_aliases,
    resolve_file_aliases,
    resolve_override_aliases,
)
from flashcp.config.convert import build_section, type_name
from flashcp.config.errors import prune_fixes, suggest
from flashcp.config.model_section import (
    build_model_args,
    command_line_model,
    pretrained_path,
    pretrained_weights,
)
from flashcp.config.overrides import Override, apply_overrides, parse_overrides
from flashcp.config.placeholders import find_placeholders, is_placeholder, placeholder_message
from flashcp.config.recipe_spec import RECIPES, extra_sections
from flashcp.config.schema import SECTIONS, Config
from flashcp.problems import Problem, ProblemsError, with_note


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML file; `ProblemsError` when unreadable or not a mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ProblemsError(
            [Problem("<file>", f"cannot read {p}: {exc.strerror or exc}")], str(p)
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProblemsError([Problem("<file>", f"not valid YAML: {exc}")], str(p)) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ProblemsError(
            [Problem("<file>", f"the top level must be a mapping of sections, got "
                                   f"{type_name(raw)}")],
            str(p),
        )  # fmt: skip
    return raw


def _mark_overrides(errors: list[Problem], overrides: Sequence[Override]) -> list[Problem]:
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

    Raises `ProblemsError` with every problem: parse errors of the overrides, unknown
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
        raise ProblemsError(errors, source)
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
) -> tuple[Config | None, list[Problem]]:
    """`(config or None, every problem)` without raising: what `flashcp validate` reports.

    A placeholder path (`/path/to/...`, `flashcp.config.placeholders`) is a problem naming its
    key and what to put there, unless `allow_placeholders` (`flashcp validate`'s static check
    of a shipped recipe): then it is accepted unchecked, and a placeholder
    `model.from_pretrained` leaves the model to the section's other keys. With
    `validate_fixes`, each problem keeps only the fixes that pass this same check once applied
    (`flashcp.config.errors.prune_fixes`)."""

    def finish(errors: list[Problem]) -> list[Problem]:
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
    notes = command_line_model(data, parsed)
    known = ["model", *SECTIONS, *extras]
    for key in data:
        if key not in known:
            errors.append(Problem(str(key), "unknown section" + suggest(str(key), known)))
    placeholders = find_placeholders(data)
    if not allow_placeholders:
        errors += [Problem(k, placeholder_message(k, v, data)) for k, v in placeholders]
    pretrained = pretrained_path(data)
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
        pretrained_weights(sections["checkpoint"], pretrained, errors)
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
            Problem(
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
) -> tuple[set[str], list[Problem]]:
    """`SECTION=null` on the command line removes an optional section (a recipe's, e.g.
    `lora=null`: no adapters) and is refused for a core one, which has no "absent" (its keys
    would silently fall back to their defaults). Returns the removed names and the refusals;
    an unknown name is left to the unknown-section check."""
    removed: set[str] = set()
    errors: list[Problem] = []
    for ov in overrides:
        name = ov.key
        if len(ov.parts) != 1 or ov.value is not None or data.get(name) is not None:
            continue  # not a section=null, or a later override gave the section keys again
        if name in extras:
            data.pop(name, None)
            removed.add(name)
        elif name in SECTIONS:  # (model=null: "required section is missing")
            errors.append(
                Problem(
                    name,
                    f"{name}=null: the {name} section is not optional and cannot be removed "
                    f"(null would silently reset every {name}.* key to its default): set the "
                    f"{name}.* keys you want to change instead",
                )
            )
    return removed, errors


def _steps_or_epochs(data: dict[str, Any], command_line: set[str]) -> list[Problem]:
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
        Problem(
            "train.epochs",
            f"train.steps ({train['steps']}) and train.epochs ({train['epochs']}) are both set "
            f"{where}: set exactly one (train.epochs counts the steps from the data's size at "
            "the start)",
        )
    ]


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
