"""Typed run configs: YAML sections → dataclasses, `key=value` overrides, all-at-once validation.

    from flashcp.config import load_config
    cfg = load_config("configs/gpt/tiny_cp2.yaml", ["train.steps=3"], world_size=2)
    cfg.parallel.cp, cfg.train.lr, cfg.model.hidden_size

A bad config raises `flashcp.problems.ProblemsError` whose `.problems` lists every problem as
`Problem(key="train.lr", message="expected a number, got 'fast' (a string)")`.
A training recipe (`run.recipe`) is declared once, as a `RecipeSpec`
(`flashcp.config.recipe_spec`; the built-in ones: `flashcp.config.recipes`).
"""

from flashcp.config.aliases import ALIASES
from flashcp.config.load import build_config, collect, load_config, read_yaml
from flashcp.config.overrides import Override, apply_overrides, parse_override, parse_overrides
from flashcp.config.recipe_spec import RECIPES, RecipeSpec, data_formats, register_recipe
from flashcp.config.recipes import DPOConfig, LoRAConfig  # registers the built-in recipes
from flashcp.config.saved import (
    config_changes,
    config_hash,
    diff_dicts,
    hashed_dict,
    to_dict,
    to_yaml,
)
from flashcp.config.schema import (
    IGNORE_INDEX,
    REPORT_BACKENDS,
    SECTIONS,
    AttentionConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DebugConfig,
    EvalConfig,
    HardwareConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from flashcp.config.validate import BYTE_VOCAB_SIZE, check_config

__all__ = [
    "ALIASES",
    "BYTE_VOCAB_SIZE",
    "IGNORE_INDEX",
    "LoRAConfig",
    "RECIPES",
    "REPORT_BACKENDS",
    "SECTIONS",
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "DPOConfig",
    "DataConfig",
    "DebugConfig",
    "EvalConfig",
    "HardwareConfig",
    "Override",
    "ParallelConfig",
    "RecipeSpec",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "build_config",
    "check_config",
    "collect",
    "config_changes",
    "config_hash",
    "data_formats",
    "diff_dicts",
    "hashed_dict",
    "load_config",
    "parse_override",
    "parse_overrides",
    "read_yaml",
    "register_recipe",
    "to_dict",
    "to_yaml",
]
