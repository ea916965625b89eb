"""The config sections recipes add: `lora` (sft, dpo) and `dpo` (dpo), and their registration.

Importing `flashcp.config` registers them (`register_recipe`), so `run.recipe: dpo` and the
`lora:` / `dpo:` sections are known to the loader, `flashcp validate` and the trainer. Field
checks that need more than a type live in `flashcp.config.validate` (collected with every other
problem, each naming its dotted key).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from flashcp.config.schema import RECIPES, RecipeSpec, register_recipe

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")
"""`dpo.loss_type` values (`flashcp.recipes.dpo_loss.LOSS_TYPES`)."""


@dataclass(kw_only=True)
class LoRAConfig:
    """LoRA adapters (PaddleFormers `paddleformers.peft`): only the adapters train."""

    rank: int = 8
    """Adapter rank r (A is [in, r], B is [r, out])."""
    alpha: float = 16.0
    """Scaling numerator: the adapter output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: [".*q_proj", ".*v_proj"])
    """Regexes matched (whole name, `re.fullmatch`) against linear layer names such as
    `model.layers.0.self_attn.q_proj`; each must match at least one linear layer."""
    merge_at_end: bool = False
    """After the last step, also write the base model with the adapters merged in
    (`<output_dir>/merged`, Hugging Face safetensors layout)."""


@dataclass(kw_only=True)
class DPOConfig:
    """Direct preference optimisation on prompt/chosen/rejected records."""

    beta: float = 0.1
    """Strength of the implicit KL penalty (> 0): rewards are beta · (log π − log π_ref)."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid (DPO), ipo or hinge (SLiC); see `flashcp.recipes.dpo_loss`."""
    label_smoothing: float = 0.0
    """Conservative DPO label smoothing in [0, 0.5) (sigmoid loss only)."""
    truncation: Literal["error", "truncate"] = "truncate"
    """An example longer than data.seq_len: cut its answers (and prompt, per max_prompt_len)
    to fit, or stop with an error naming it."""
    max_prompt_len: int | None = None
    """When truncating, keep at most this many (last) prompt tokens; null = no prompt limit."""


register_recipe(replace(RECIPES["sft"], sections={**RECIPES["sft"].sections, "lora": LoRAConfig}))
register_recipe(
    RecipeSpec(
        "dpo",
        "DPO on prompt/chosen/rejected pairs packed with the share-question FlashMask",
        sections={"dpo": DPOConfig, "lora": LoRAConfig},
        settings=("dpo",),
    )
)
