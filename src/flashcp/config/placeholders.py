"""Placeholders in shipped recipes: paths the user fills in, such as `/path/to/GLM-4-9B-0414`.

A real-size recipe (`configs/glm/glm4_9b_cp8.yaml`, ...) cannot ship a model directory or a
dataset, so it names them with a value that starts with `PREFIX` (`/path/to/`). Such a value
is accepted by `flashcp validate` (a static check of shapes and arithmetic: the model section
restates the model directory's config.json, so the shapes are known without it) and listed
there as still to fill; everything that trains — `flashcp train`, a rank started by
`paddle.distributed.launch`, a `Trainer` built in code — refuses it before any compute, naming
the key and what to put there (`load_config` / `build_config` / `collect` refuse them unless
called with `allow_placeholders=True`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashcp.config.recipe_spec import RECIPES

PREFIX = "/path/to/"
"""A value starting with this is a placeholder (never a real path on any machine)."""

_DATA_FILES = "a JSON Lines (.jsonl) or Parquet (.parquet) file (or a directory of them) of"


def is_placeholder(value: Any) -> bool:
    """Whether `value` is a placeholder path still to be filled in."""
    return isinstance(value, str) and value.startswith(PREFIX)


def find_placeholders(raw: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`(dotted key, value)` of every placeholder among the `section.key` values of `raw`."""
    found = []
    for section, values in raw.items():
        if not isinstance(values, Mapping):
            continue
        for key, value in values.items():
            if is_placeholder(value):
                found.append((f"{section}.{key}", value))
    return found


def _field(raw: Mapping[str, Any], name: str, default: str) -> str:
    data = raw.get("data")
    value = data.get(name) if isinstance(data, Mapping) else None
    return value if isinstance(value, str) else default


def data_format(raw: Mapping[str, Any]) -> str:
    """What `data.path` must hold for the recipe of `raw` (`run.recipe`: the kind of example
    it reads, `RecipeSpec.examples`), in its field names."""
    run = raw.get("run")
    recipe = run.get("recipe", "pretrain") if isinstance(run, Mapping) else "pretrain"
    spec = RECIPES.get(recipe) if isinstance(recipe, str) else None
    examples = spec.examples if spec is not None else "text"
    f = {
        name: _field(raw, f"{name}_field", name)
        for name in ("messages", "prompt", "response", "chosen", "rejected", "text")
    }
    if examples == "preference":
        return (
            f"{_DATA_FILES} preference records, {f['prompt']!r}, {f['chosen']!r} and "
            f"{f['rejected']!r} strings (or a {f['prompt']!r} list of messages with the answers "
            "as assistant turns)"
        )
    if examples == "supervised":
        return (
            f"{_DATA_FILES} conversations, a {f['messages']!r} list of "
            '{"role", "content"} messages per record (loss on the assistant turns; or '
            f"{f['prompt']!r}/{f['response']!r} strings)"
        )
    return f"{_DATA_FILES} documents with a {f['text']!r} field"


def what_to_put(key: str, raw: Mapping[str, Any]) -> str:
    """The sentence that says what a filled-in `key` holds."""
    if key == "model.from_pretrained":
        return (
            "a Hugging Face model directory holding config.json, the safetensors weights "
            "(model.safetensors, or model.safetensors.index.json and its shards) and "
            "tokenizer.json + tokenizer_config.json"
        )
    if key == "data.path":
        return data_format(raw)
    if key == "eval.path":
        return f"held-out data in the training data's format ({data_format(raw)}), or null"
    if key == "data.tokenizer":
        return (
            "a tokenizer directory (tokenizer.json + tokenizer_config.json) or a "
            "tokenizer.json file (or remove the key: model.from_pretrained's tokenizer)"
        )
    if key == "checkpoint.init_from":
        return (
            "a safetensors checkpoint (a file, or a directory with "
            "model.safetensors[.index.json])"
        )
    return "a real path"


def placeholder_message(key: str, value: str, raw: Mapping[str, Any]) -> str:
    """The refusal of placeholder `value` at `key` (`raw`: the whole config, for the recipe)."""
    name = "DIR" if key == "model.from_pretrained" else "PATH"
    return (
        f"{value!r} is a placeholder still to fill in (in the file, or as {key}={name} on the "
        f"command line) with {what_to_put(key, raw)}"
    )
