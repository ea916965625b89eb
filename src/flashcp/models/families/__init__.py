"""THE registry of model families: `ModelArgs.arch` → its `Family` (`flashcp.models.families.spec`).

A model family is one file here that builds one `Family(...)`, registered below: its layers'
building blocks, the values its reference class always computes, its presets, and its Hugging
Face side (`flashcp.models.families.hf.HFSide`). Everyone else asks this registry — the builder
(`flashcp.models.build_model`), `ModelArgs` (validation, which layers are MoE, the rotary
pairing), the config.json reader and writer (`flashcp.models.hf_config`), the weight loader and
exporter (`flashcp.models.hf_state`), the parameter inventory and FLOPs
(`flashcp.models.families.inventory`), the planner and the config checks — and no module outside
this package compares `arch` to a family's name (`tests/unit/repo/test_family_registry.py`).
`docs/models.md` ("Adding a model family") walks through one file.

No Paddle here: the config and planner layers read the declarations without it.
"""

from __future__ import annotations

from flashcp.models.families.spec import Family

FAMILIES: dict[str, Family] = {}
"""arch → family, in registration order."""


def register(fam: Family) -> Family:
    """Add `fam` under its `arch` (a second family of the same arch is refused)."""
    if fam.arch in FAMILIES and FAMILIES[fam.arch] is not fam:
        raise ValueError(f"a model family with arch {fam.arch!r} is registered already")
    FAMILIES[fam.arch] = fam
    return fam


def family(arch: str) -> Family:
    """The family of `arch`; `ValueError` naming the known ones."""
    try:
        return FAMILIES[arch]
    except (KeyError, TypeError):
        raise ValueError(
            f"arch {arch!r} is not a model family flashcp builds: use one of "
            f"{', '.join(FAMILIES)}"
        ) from None


def names() -> tuple[str, ...]:
    """The registered archs, in registration order."""
    return tuple(FAMILIES)


def _register_shipped() -> None:
    from flashcp.models.families import (
        ernie4_5,
        ernie4_5_moe,
        glm4,
        glm4_moe,
        gpt,
        llama,
        qwen2,
        qwen3,
        qwen3_moe,
    )

    for module in (gpt, glm4, glm4_moe, ernie4_5, ernie4_5_moe, llama, qwen2, qwen3, qwen3_moe):
        register(module.FAMILY)


_register_shipped()

__all__ = ["FAMILIES", "Family", "family", "names", "register"]
