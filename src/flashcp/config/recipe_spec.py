"""What a training recipe declares, once: `RecipeSpec`, the registry `RECIPES`, and the tables
everyone derives from it.

A recipe (`run.recipe`) is one `register_recipe(RecipeSpec(...))` (the built-in ones:
`flashcp.config.recipes`): its config sections, the data formats it reads (`data.format`
names, in the order `auto` tries them) and the kind of example it makes of a row, its
validation rules, and its trainer class, named as "module:attribute" and imported only when a
run builds it (`flashcp.recipes.recipe_class`). The loader and `flashcp validate` (sections,
`data.format`, rules), format detection (`flashcp.data.formats`) and the trainer all ask this
one declaration. It is data and functions of a `Config`: no Paddle, no recipe code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from flashcp.config.checks import Checks
from flashcp.config.schema import Config

Examples = Literal["text", "supervised", "preference"]
"""What a recipe's data makes of a row: `text` (a document, every token trained),
`supervised` (a prompt or conversation and the answers trained on), `preference` (a prompt, a
chosen and a rejected answer). A data format has one reader per kind it serves
(`flashcp.data.formats.Format.examples`): `paddleformers` rows are read one way for sft and
another for dpo."""

Rule = Callable[[Config, Checks], None]
"""A validation rule: reports the problems of a `Config` to `Checks`, each naming its key."""


@dataclass(frozen=True)
class RecipeSpec:
    """A training recipe: its name and everything the config, the data and the trainer need
    to know about it."""

    name: str
    description: str
    sections: dict[str, type] = field(default_factory=dict)
    """Extra top-level sections this recipe reads (e.g. `lora`, `dpo`), name → dataclass."""
    settings: tuple[str, ...] = ()
    """Those of `sections` the recipe reads with or without them (absent: their defaults, as
    `dpo` for the dpo recipe), unlike a section whose presence turns something on (`lora`):
    `SECTION=null` on the command line cannot remove them (it would silently reset them)."""
    examples: Examples | None = None
    """The kind of example its data makes of a row (None: it reads no data formats)."""
    formats: tuple[str, ...] = ()
    """The `data.format` names it reads, in the order `data.format: auto` tries them."""
    rules: tuple[Rule, ...] = ()
    """Its validation rules, run by `flashcp.config.validate.check_config` when it is the
    run's recipe."""
    implementation: str | None = None
    """Its trainer class (`flashcp.recipes.base.Recipe`) as "module:attribute", imported when
    a run builds it (None: a config-only recipe, which no trainer runs)."""


RECIPES: dict[str, RecipeSpec] = {}
"""Every recipe by name, in registration order."""


def register_recipe(spec: RecipeSpec) -> RecipeSpec:
    """Make `spec.name` a valid `run.recipe`, its sections valid top-level keys and its formats
    valid `data.format` values."""
    if spec.formats and spec.examples is None:
        raise ValueError(f"recipe {spec.name!r} reads data formats but says no `examples` kind")
    RECIPES[spec.name] = spec
    return spec


def extra_sections() -> dict[str, type]:
    """Every section some registered recipe adds, name → dataclass."""
    out: dict[str, type] = {}
    for spec in RECIPES.values():
        out.update(spec.sections)
    return out


def data_formats() -> dict[str, tuple[str, ...]]:
    """`data.format` values → the recipes that read them: `auto` (every recipe that reads
    data formats) first, then each format in the order the recipes list them."""
    table: dict[str, tuple[str, ...]] = {
        "auto": tuple(name for name, spec in RECIPES.items() if spec.formats)
    }
    for name, spec in RECIPES.items():
        for fmt in spec.formats:
            table[fmt] = (*table.get(fmt, ()), name)
    return table
