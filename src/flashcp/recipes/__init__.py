"""Training recipes: what a step computes (data, loss, statistics, metrics); the trainer
(`flashcp.trainer`) runs them under any dp × pp × cp layout.

* `flashcp.recipes.base`: the `Recipe` interface the trainer calls.
* `flashcp.recipes.lm`: `pretrain` / `sft` (next-token cross-entropy on packed documents).
* `flashcp.recipes.dpo`: `dpo` (share-question packed preference pairs, DPO losses, reference
  log-probs from a frozen copy or the LoRA model with adapters off, CP-summed answer log-probs);
  its data is `flashcp.data.dpo_records` / `dpo_packing` / `dpo_stream`.
* `flashcp.recipes.dpo_loss`: answer log-prob sums over packed spans and the DPO losses.

A recipe is declared once, in the config layer (`flashcp.config.recipe_spec.RecipeSpec`: its
sections, data formats, rules and `implementation`, the class here as "module:attribute");
`recipe_class` imports the class a declaration names, `build_recipe` makes the run's.
"""

from __future__ import annotations

import functools
import importlib

from flashcp.config import RECIPES, Config
from flashcp.distributed import ParallelGroups
from flashcp.recipes.base import Recipe


def recipe_class(name: str) -> type[Recipe]:
    """The trainer class of `run.recipe` `name`: its declaration's `implementation`, imported
    the first time it is asked for."""
    spec = RECIPES.get(name)
    if spec is None or spec.implementation is None:
        raise ValueError(f"run.recipe {name!r} has no trainer recipe")
    return _load(spec.implementation)


@functools.cache
def _load(path: str) -> type[Recipe]:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def build_recipe(cfg: Config, groups: ParallelGroups) -> Recipe:
    """The recipe object of `run.recipe`."""
    return recipe_class(cfg.run.recipe)(cfg, groups)
