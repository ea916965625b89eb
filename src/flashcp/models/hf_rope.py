"""RoPE in a Hugging Face ``config.json``, read and written, without Paddle.

The rotary embedding is the one part of a config.json that comes in two layouts: transformers
4.x (and PaddleFormers) write top-level ``rope_theta`` / ``rope_scaling`` /
``partial_rotary_factor``, transformers 5.x one ``rope_parameters: {rope_type, rope_theta,
...}``. `read_rope` accepts either (or both, when they agree) and gives `ModelArgs`' RoPE
fields; plain RoPE (``rope_type`` "default") and Llama-3.1's ``llama3`` frequency scaling
(``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``;
`flashcp.models.rope`) are implemented, any other type or key (per-layer-type dicts) is refused,
and so are the two layouts giving different values. `rope_config` writes both layouts, so
every reader finds its own. Kept apart from the rest of the config.json reader
(`flashcp.models.hf_config`) because the two layouts and their agreement are a rule of their
own, shared by reading and writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import is_number

ROPE_FIELDS: dict[str, str] = {
    "rope_scaling": "rope_parameters.rope_type",
    "rope_factor": "rope_parameters.factor",
    "rope_low_freq_factor": "rope_parameters.low_freq_factor",
    "rope_high_freq_factor": "rope_parameters.high_freq_factor",
    "rope_original_max_len": "rope_parameters.original_max_position_embeddings",
}
"""The scaled-RoPE fields and the config.json keys that set them."""
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")  # fmt: skip
_ROPE_TYPES = ("default", "llama3")


def _same(a: Any, b: Any) -> bool:
    if is_number(a) and is_number(b):
        return float(a) == float(b)
    return bool(a == b)


def read_rope(
    config: Mapping[str, Any], defaults: Mapping[str, Any], problems: list[tuple[str, str]]
) -> dict[str, Any]:
    """The RoPE fields of `ModelArgs` (`rotary_base`, `partial_rotary_factor`, `rope_scaling`
    and its numbers) from either layout; unimplemented variants and contradictions between the
    layouts go to `problems`."""
    legacy = config.get("rope_scaling")
    params = config.get("rope_parameters")
    layouts: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    for name, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value in (None, {}):
            continue
        if not isinstance(value, Mapping):
            problems.append((name, f"{value!r} must be an object"))
        elif any(isinstance(v, Mapping) for v in value.values()):
            problems.append(
                (
                    name,
                    "per-layer-type RoPE parameters are not implemented (flashcp computes one "
                    f"RoPE for every layer): {sorted(value)}",
                )
            )
        else:
            layouts.append((f"{name}.", value))
    found: dict[str, tuple[str, Any]] = {}
    for prefix, mapping in layouts:
        keys = ("rope_theta", "partial_rotary_factor") if not prefix else tuple(mapping)
        for key in keys:
            value = mapping.get(key)
            if value is None:
                continue
            canonical = "rope_type" if key == "type" else key
            if canonical not in _ROPE_KEYS | set(_LLAMA3_KEYS):
                problems.append(
                    (
                        f"{prefix}{key}",
                        f"not implemented (flashcp's RoPE takes rope_type {_ROPE_TYPES}, "
                        f"rope_theta, partial_rotary_factor and llama3's {list(_LLAMA3_KEYS)})",
                    )
                )
                continue
            if canonical in found and not _same(found[canonical][1], value):
                first, got = found[canonical]
                where = f"{first}{canonical}" if first else f"the top-level {canonical}"
                problems.append(
                    (f"{prefix}{key}", f"{value!r} contradicts {where} {got!r}: fix config.json")
                )
                continue
            found.setdefault(canonical, (prefix, value))
    rope_type = found.get("rope_type", ("", "default"))[1]
    if rope_type not in _ROPE_TYPES:
        problems.append(
            (
                "rope_parameters.rope_type",
                f"{rope_type!r} is not implemented: flashcp computes plain RoPE ('default') and "
                "Llama-3's 'llama3' scaling",
            )
        )
    values: dict[str, Any] = {}
    for field, key in (("rotary_base", "rope_theta"), ("partial_rotary_factor",
                                                       "partial_rotary_factor")):  # fmt: skip
        value = found[key][1] if key in found else defaults.get(key, 1.0)
        if not is_number(value):
            problems.append((key, f"{value!r} must be a number"))
            value = 0.0
        values[field] = float(value)
    values["rope_scaling"] = "llama3" if rope_type == "llama3" else "none"
    if rope_type != "llama3":
        stray = sorted(k for k in _LLAMA3_KEYS if k in found)
        if stray:
            problems.append(
                ("rope_parameters", f"keys {stray} belong to rope_type 'llama3', not {rope_type!r}")
            )
        return values
    for field, key in zip(("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                           "rope_original_max_len"), _LLAMA3_KEYS, strict=True):  # fmt: skip
        if key not in found and key == "original_max_position_embeddings":
            # transformers' standardize_rope_params: the model's max_position_embeddings
            found[key] = ("", config.get("max_position_embeddings",
                                         defaults.get("max_position_embeddings")))  # fmt: skip
        if key not in found:
            problems.append(
                (f"rope_parameters.{key}", "rope_type 'llama3' needs it (transformers does too)")
            )
            continue
        value = found[key][1]
        integer = field == "rope_original_max_len"
        if not is_number(value) or integer and value != int(value):
            problems.append((f"rope_parameters.{key}", f"{value!r} must be a number"))
            continue
        values[field] = int(value) if integer else float(value)
    return values


def rope_config(args: ModelArgs, partial: bool) -> dict[str, Any]:
    """The RoPE keys of an export, in both layouts (`partial`: write partial_rotary_factor)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rotary_base}
    if partial:
        params["partial_rotary_factor"] = args.partial_rotary_factor
    scaling = None
    if args.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": args.rope_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
        params.update(scaling)
    out: dict[str, Any] = {"rope_theta": args.rotary_base, "rope_scaling": scaling,
                           "rope_parameters": params}  # fmt: skip
    if partial:
        out["partial_rotary_factor"] = args.partial_rotary_factor
    return out
