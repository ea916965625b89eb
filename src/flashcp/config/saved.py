"""The config as a run saves it, and what a checkpoint binds: `to_dict` / `to_yaml` (plain
data, reloadable), `hashed_dict` / `config_hash` (the keys that change what a step computes)
and `config_changes` (what differs from a checkpoint's saved config, counting keys added
since at the value earlier runs computed with).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml

from flashcp.config.convert import section_dict
from flashcp.config.schema import SECTIONS, Config, config_key

_MISSING = object()


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (the `model` section with every field, no preset;
    with `train.epochs` no `train.steps`, which the epochs give at the start)."""
    model = section_dict(cfg.model)
    if cfg.model_from_pretrained is not None:
        model = {"from_pretrained": cfg.model_from_pretrained, **model}
    out: dict[str, Any] = {"model": model}
    for name in SECTIONS:
        out[name] = section_dict(getattr(cfg, name))
    if cfg.train.epochs is not None:
        out["train"].pop("steps", None)
    for name, value in cfg.extras.items():
        out[name] = section_dict(value)
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
