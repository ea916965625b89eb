"""The `model` section: a `flashcp.models.ModelArgs` from `preset: <name>`, from
`from_pretrained: <HF model directory>` (its config.json, which must build exactly, its
safetensors weights present, no key of the section contradicting it, MTP layers it holds) or
from every field, plus what a model directory implies for the rest of the config (its
weights as `checkpoint.init_from`) and a command-line `model.from_pretrained` replacing the
file's preset.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from flashcp.config.convert import build_section, convert, section_dict
from flashcp.config.errors import suggest
from flashcp.config.overrides import Override
from flashcp.problems import Problem, as_fix


def _model_api() -> tuple[type, dict[str, Any]]:
    """`(ModelArgs, {preset name: ModelArgs})` from `flashcp.models` (imported lazily)."""
    from flashcp.models import PRESETS, ModelArgs

    return ModelArgs, {name: getattr(p, "args", p) for name, p in PRESETS.items()}


def build_model_args(
    raw: Any, errors: list[Problem], *, given: Collection[str] = ()
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
            Problem(
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
            Problem(
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
                Problem(
                    "model.preset",
                    f"unknown preset {preset!r}"
                    + suggest(str(preset), presets).replace("valid keys", "presets"),
                )
            )
            preset = None
        else:
            base = section_dict(presets[preset])
    args = build_section(
        ModelArgs, raw, "model", errors, base=base, ignore=("preset", "from_pretrained")
    )
    return args, preset


def _pretrained_values(raw: Mapping[str, Any], errors: list[Problem]) -> dict[str, Any] | None:
    """ModelArgs values from `model.from_pretrained`'s config.json (None after an error): the
    directory must hold a config.json flashcp builds exactly and safetensors weights, and no
    other key of the section may contradict it."""
    from flashcp.models.hf_config import (
        FIELD_KEYS,
        TRAINING_FIELDS,
        HFConfigError,
        parse_hf_config,
        read_config_json,
    )
    from flashcp.models.hf_mtp import mtp_problems
    from flashcp.models.weight_files import WEIGHT_FILES

    ModelArgs, _ = _model_api()
    path = raw["from_pretrained"]
    key = "model.from_pretrained"
    if not isinstance(path, str) or not path.strip():
        errors.append(Problem(key, f"expected a directory path, got {path!r}"))
        return None
    directory = Path(path)
    if not directory.is_dir():
        errors.append(
            Problem(key, f"no directory at {path!r}: give a Hugging Face model directory "
                             "(config.json, model.safetensors[.index.json], tokenizer files)")
        )  # fmt: skip
        return None
    try:
        config, source = read_config_json(directory)
        values, _notes = parse_hf_config(config, source)
    except HFConfigError as exc:
        for hf_key, message in exc.problems:
            errors.append(Problem(key, f"{exc.source}: {hf_key}: {message}"))
        return None
    except (OSError, ValueError) as exc:
        errors.append(Problem(key, str(exc)))
        return None
    if not any((directory / f).is_file() for f in WEIGHT_FILES):
        errors.append(
            Problem(key, f"{path} has no {' or '.join(WEIGHT_FILES)}: the weights are "
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
        good, given = convert(value, hints.get(name, Any))
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
            errors.append(Problem(
                f"model.{name}", problem, fixes=(as_fix({f"model.{name}": None}),),
                other=f"remove model.{name} from the file",
            ))  # fmt: skip
            ok = False
    declared = values.get("mtp_layers", 0)
    asked = raw.get("mtp_layers", declared)
    if convert(asked, int)[0]:  # a bad value is build_section's to report
        try:
            found = mtp_problems(directory, values["num_layers"], declared, asked)
        except (OSError, ValueError) as exc:
            found = [Problem("model.mtp_layers", str(exc))]
        if found:
            errors += found
            ok = False
    return values if ok else None


def command_line_model(data: dict[str, Any], overrides: Sequence[Override]) -> list[str]:
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


def pretrained_path(data: Mapping[str, Any]) -> str | None:
    model = data.get("model")
    path = model.get("from_pretrained") if isinstance(model, Mapping) else None
    return path if isinstance(path, str) else None


def pretrained_weights(checkpoint: Any, pretrained: str, errors: list[Problem]) -> None:
    """`model.from_pretrained` implies `checkpoint.init_from` (the same directory's weights); a
    different `init_from` contradicts it. A resumed run restores its own checkpoint either way."""
    if checkpoint.init_from is None:
        checkpoint.init_from = pretrained
    elif Path(checkpoint.init_from).resolve() != Path(pretrained).resolve():
        errors.append(
            Problem(
                "checkpoint.init_from",
                f"{checkpoint.init_from!r} contradicts model.from_pretrained {pretrained!r}, "
                "which loads that directory's weights: remove checkpoint.init_from (or "
                "model.from_pretrained, and give the model section yourself)",
            )
        )
