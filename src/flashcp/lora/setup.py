"""LoRA in the trainer: adapters from the `lora` config section, applied to a built model or
pipeline stage (`apply_lora_config`, the last step of `flashcp.parallelize`), and what the
adapter files need of it (`LoRASetup`).

The adapters are saved, loaded back and merged by `flashcp.checkpoint` (`adapters`,
`checkpointer`, `merge_export`), in PaddleFormers' format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle

from flashcp.distributed import all_gather_object
from flashcp.lora.model import apply_lora, check_targets, target_summary


@dataclass
class LoRASetup:
    """What the trainer keeps of a `LoRAModel` after the full model is split into stages: the
    PaddleFormers configs that go next to the saved adapters."""

    lora_config: Any
    model_config: Any


def apply_lora_config(
    model: paddle.nn.Layer, section: Any, *, group: Any = None, seed: int | None = None
) -> LoRASetup:
    """Apply the `lora` config section to `model` in place (only adapters stay trainable).

    `model` may be one pipeline stage: `group` (the pp group) pools every stage's matches so a
    pattern need only match on some stage (the check raises the same error on every rank).
    `seed` keys the adapters' initial values by name (`flashcp.lora.model.init_adapters`).
    """
    patterns = list(section.target_modules)
    summary = target_summary(model, patterns)
    summaries = [summary]
    if group is not None and int(group.nranks) > 1:
        summaries = all_gather_object(summary, group)
    check_targets(summaries)
    lora = apply_lora(
        model,  # type: ignore[arg-type]
        rank=int(section.rank),
        alpha=float(section.alpha),
        dropout=float(section.dropout),
        target_modules=patterns,
        seed=seed,
        require_match=False,
    )
    return LoRASetup(lora_config=lora.lora_config, model_config=model.config)
