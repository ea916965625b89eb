"""The built-in recipes' declarations — pretrain, sft, dpo — and the sections they add (`lora`,
`dpo`): each recipe's sections, data formats, validation rules and trainer class, in one
`RecipeSpec` (`flashcp.config.recipe_spec`).

Importing `flashcp.config` registers them, so `run.recipe: dpo` and the `lora:` / `dpo:`
sections are known to the loader, `flashcp validate`, format detection and the trainer. A
recipe's rules are the checks that depend on it (its sections' values, the masks it trains
with); the rules every recipe shares live in `flashcp.config.validate`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from flashcp.config.checks import Checks, positive
from flashcp.config.recipe_spec import RecipeSpec, register_recipe
from flashcp.config.schema import Config

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


# ------------------------------------------------------------------------------ the rules


def check_lora(cfg: Config, c: Checks) -> None:
    """The `lora` section (sft, dpo): adapter shape, dropout, target regexes; a router that
    moves its biases cannot train under adapters."""
    lora = cfg.extras.get("lora")
    if lora is None:
        return
    rate = getattr(cfg.model, "router_bias_update_rate", 0.0)
    if isinstance(rate, (int, float)) and rate > 0:
        c.add(
            "model.router_bias_update_rate",
            f"is {rate}, but with a lora section the router is frozen and only the adapters "
            "are trained and saved (the moved biases would be lost at resume)",
            fixes=[{"model.router_bias_update_rate": 0}, {"lora": None}],
        )
    if lora.rank < 1:
        c.add("lora.rank", f"must be an integer >= 1, got {lora.rank}")
    positive(c, "lora.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        c.add("lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    if not c.ok("lora.target_modules"):
        return
    if not lora.target_modules:
        c.add("lora.target_modules", "is empty (regexes of the linear layers to adapt)",
              fixes=[{"lora.target_modules": [".*q_proj", ".*v_proj"]}])  # fmt: skip
    for pattern in lora.target_modules:
        try:
            re.compile(pattern)
        except re.error as exc:
            c.add("lora.target_modules", f"{pattern!r} is not a regular expression ({exc})")


def check_pretrain_prefix(cfg: Config, c: Checks) -> None:
    """Under `attention.mask: prefix_lm` pretrain's prefix is the first `attention.prefix_len`
    tokens of each document: set, >= 1, and leaving a token to train."""
    a = cfg.attention
    n = a.prefix_len
    if a.mask != "prefix_lm":
        return
    if n is None:
        c.add(
            "attention.prefix_len",
            "attention.mask prefix_lm with the pretrain recipe needs attention.prefix_len: "
            "the first tokens of each document that see each other both ways and get no "
            f"loss (e.g. {max(1, cfg.data.seq_len // 4)})",
            "attention.mask",
        )
    elif n < 1:
        c.add("attention.prefix_len", f"must be >= 1 token, got {n}")
    elif n >= cfg.data.seq_len:
        c.add(
            "attention.prefix_len",
            f"{n} leaves no trained token in a {cfg.data.seq_len}-token sequence: set "
            f"attention.prefix_len below data.seq_len (e.g. {max(1, cfg.data.seq_len // 4)})",
            "data.seq_len",
        )


def check_sft_prefix(cfg: Config, c: Checks) -> None:
    """Under `attention.mask: prefix_lm` sft's prefix is each example's prompt, not a length."""
    a = cfg.attention
    if a.mask == "prefix_lm" and a.prefix_len is not None:
        c.add(
            "attention.prefix_len",
            f"{a.prefix_len}: with the sft recipe each example's prefix is its prompt (every "
            "token before the first trained one); remove attention.prefix_len",
            "run.recipe",
        )


def check_dpo_mask(cfg: Config, c: Checks) -> None:
    """dpo trains under its share-question mask, which has no window or prefix form."""
    mask = cfg.attention.mask
    if mask != "causal":
        c.add(
            "attention.mask",
            f"{mask} cannot be used with the dpo recipe: dpo packs preference pairs under its "
            "share-question mask (each answer sees its prompt and itself), which has no "
            "window or prefix form here; set attention.mask: causal (or train the windowed / "
            "prefix model with pretrain or sft)",
            "run.recipe",
        )


def check_dpo_mtp(cfg: Config, c: Checks) -> None:
    """The dpo recipe trains no MTP layer (`model.mtp_loss_weight` 0: carried frozen)."""
    weight = getattr(cfg.model, "mtp_loss_weight", 0)
    if isinstance(weight, (int, float)) and weight > 0 and c.ok("model.mtp_loss_weight"):
        c.add(
            "model.mtp_loss_weight",
            f"{weight} trains the MTP layers with a cross-entropy, but the dpo recipe's loss "
            "compares answer log-probabilities with its reference model's: an MTP "
            "cross-entropy on both answers would also pull the policy toward the rejected "
            "one (with 0 the MTP layers are carried frozen and exported unchanged; train them "
            "with the sft recipe)",
            fixes=[{"model.mtp_loss_weight": 0}],
        )


def check_dpo_section(cfg: Config, c: Checks) -> None:
    """The `dpo` section's values, when given (absent: its defaults)."""
    dpo = cfg.extras.get("dpo")
    if dpo is None:
        return
    positive(c, "dpo.beta", dpo.beta)
    if not 0.0 <= dpo.label_smoothing < 0.5:
        c.add("dpo.label_smoothing", f"must be in [0, 0.5), got {dpo.label_smoothing}")
    elif dpo.label_smoothing and dpo.loss_type != "sigmoid":
        c.add(
            "dpo.label_smoothing",
            f"applies to the sigmoid loss only; dpo.loss_type is {dpo.loss_type}",
            "dpo.loss_type",
            fixes=[{"dpo.label_smoothing": 0}, {"dpo.loss_type": "sigmoid"}],
        )
    if dpo.max_prompt_len is not None and dpo.max_prompt_len < 2:
        c.add("dpo.max_prompt_len", f"must be >= 2 or null, got {dpo.max_prompt_len}")
    if cfg.data.seq_len < 3 and c.ok("data.seq_len"):
        c.add("data.seq_len", f"a DPO row needs >= 3 tokens, got {cfg.data.seq_len}")


# ---------------------------------------------------------------------------- the recipes

PRETRAIN = register_recipe(
    RecipeSpec(
        "pretrain",
        "next-token loss on every token of packed documents",
        examples="text",
        formats=("text",),
        rules=(check_pretrain_prefix,),
        implementation="flashcp.recipes.lm:LMRecipe",
    )
)
SFT = register_recipe(
    RecipeSpec(
        "sft",
        "loss on response tokens only (prompt/response JSONL)",
        sections={"lora": LoRAConfig},
        examples="supervised",
        formats=("messages", "sharegpt", "paddleformers", "alpaca", "prompt_response"),
        rules=(check_sft_prefix, check_lora),
        implementation="flashcp.recipes.lm:SFTRecipe",
    )
)
DPO = register_recipe(
    RecipeSpec(
        "dpo",
        "DPO on prompt/chosen/rejected pairs packed with the share-question FlashMask",
        sections={"dpo": DPOConfig, "lora": LoRAConfig},
        settings=("dpo",),
        examples="preference",
        formats=("paddleformers", "ultrafeedback", "preference", "implicit_prompt"),
        rules=(check_dpo_mask, check_lora, check_dpo_mtp, check_dpo_section),
        implementation="flashcp.recipes.dpo:DPORecipe",
    )
)
