"""Shipped model presets, gathered from the model families (`flashcp.models.families`): each
family declares its own — CPU-sized ones for tests and smoke runs (``tiny_<family>``,
``small``...) and real shapes (``glm4_9b``, ``glm45_air``, ``ernie45_21b_a3b``, ``llama31_8b``,
``qwen3_8b``, ``qwen3_30b_a3b``...). Real shapes are *built only on GPU* (`build_model` refuses
them on CPU, where they would need tens of GB) but *validated everywhere*: `preset(name)`
returns checked `ModelArgs` on any machine, so configs that use them fail early and clearly.
"""

from __future__ import annotations

import dataclasses

from flashcp.models.config import ModelArgs
from flashcp.models.families import FAMILIES
from flashcp.models.families.spec import BYTE_VOCAB, Preset

__all__ = ["BYTE_VOCAB", "PRESETS", "Preset", "preset"]

PRESETS: dict[str, Preset] = {
    name: p for fam in FAMILIES.values() for name, p in fam.presets.items()
}
"""Preset name → `Preset`, every family's."""


def preset(name: str, **overrides: object) -> ModelArgs:
    """The checked `ModelArgs` of a preset, with field overrides applied."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not known: use one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name].args, **overrides).check()  # type: ignore[arg-type]
