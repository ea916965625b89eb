"""The trainer class of the toy recipe `tests/unit/recipes/test_recipe_declaration.py` declares
from outside `src/`: pretrain's next-token loss, multiplied by its `toy.scale` section. The
declaration names it as "helpers.toy_recipe:ToyRecipe"; `flashcp.recipes.recipe_class` imports
it from there."""

from __future__ import annotations

from typing import Any

import paddle

from flashcp.config import Config
from flashcp.distributed import ParallelGroups
from flashcp.models import HeadInput
from flashcp.pipeline.runner import MicroBatch
from flashcp.recipes.lm import LMRecipe


class ToyRecipe(LMRecipe):
    """`toy_lm`: the LM loss times `toy.scale` (1 without a `toy` section)."""

    name = "toy_lm"

    def __init__(self, cfg: Config, groups: ParallelGroups) -> None:
        super().__init__(cfg, groups)
        section = cfg.extras.get("toy")
        self.scale = 1.0 if section is None else float(section.scale)

    def loss(self, out: HeadInput, mb: MicroBatch) -> tuple[paddle.Tensor, list[Any]]:
        loss, stats = super().loss(out, mb)
        return loss * self.scale, stats
