"""Training recipes: what a step computes (data, loss, statistics, metrics); the trainer
(`flashcp.trainer`) runs them under any dp × pp × cp layout.

* `flashcp.recipes.base`: the `Recipe` interface the trainer calls.
* `flashcp.recipes.lm`: `pretrain` / `sft` (next-token cross-entropy on packed documents).
* `flashcp.recipes.dpo`: `dpo` (share-question packed preference pairs, DPO losses, reference
  log-probs from a frozen copy or the LoRA model with adapters off, CP-summed answer log-probs);
  its data is `flashcp.data.dpo_records` / `dpo_packing` / `dpo_stream`.
* `flashcp.recipes.dpo_loss`: answer log-prob sums over packed spans and the DPO losses.

`RECIPE_CLASSES` maps `run.recipe` (its config spec: `flashcp.config.RECIPES`) to its class;
`build_recipe` makes the run's.
"""

from __future__ import annotations

from flashcp.config import Config
from flashcp.distributed import ParallelGroups
from flashcp.recipes.base import Recipe
from flashcp.recipes.dpo import DPORecipe
from flashcp.recipes.lm import LMRecipe, SFTRecipe

RECIPE_CLASSES: dict[str, type[Recipe]] = {"pretrain": LMRecipe, "sft": SFTRecipe, "dpo": DPORecipe}


def build_recipe(cfg: Config, groups: ParallelGroups) -> Recipe:
    """The recipe object of `run.recipe`."""
    name = cfg.run.recipe
    if name not in RECIPE_CLASSES:
        raise ValueError(f"run.recipe {name!r} has no trainer recipe")
    return RECIPE_CLASSES[name](cfg, groups)
