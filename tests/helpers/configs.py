"""Tiny configs for in-process tests: a base (config sections as a dict) with the test's own
sections merged over it section by section, the run directory under the test's `tmp`.

A base names what a family of tests shares; a test module whose runs differ in a few keys
starts from `merged(base, ...)` so every run keeps the exact config it always had."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flashcp.config import Config, build_config

Sections = Mapping[str, Mapping[str, Any]]
"""Config sections by name, as a YAML file holds them."""
TinyCfg = Callable[..., Config]
"""The type of the `tiny_cfg` fixture."""

TINY_LM: Sections = {
    "model": {"preset": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64, "micro_batch_size": 2},
    "train": {"steps": 6, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "seed": 0},
}
"""The tiny GPT on the built-in corpus, at a learning rate that moves it within a few steps."""

TINY_GLM: Sections = {
    "model": {"preset": "tiny_glm"},
    "data": {"seq_len": 128, "micro_batch_size": 1},
}
"""The tiny GLM (rotary, GQA, SwiGLU), one 128-token row per micro-batch."""

TINY_GLM_ACCUM: Sections = {
    **TINY_GLM,
    "train": {"lr": 3e-3, "warmup_steps": 0, "grad_accum": 2},
    "checkpoint": {"every": 0, "save_last": False},
}
"""The tiny GLM trained with two micro-batches per step, no checkpoints (LM and DPO recipes)."""

PLANNED: Sections = {
    **TINY_GLM,
    "train": {"steps": 3, "warmup_steps": 1, "loss_chunk_tokens": 0},
    "checkpoint": {"resume": "never", "save_last": False},
    "run": {"output_dir": "/nonexistent/run"},
}
"""What the planner tests ask about: the tiny GLM, its loss unchunked; nothing is written."""


def merged(base: Sections, **sections: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A copy of `base` with each of `sections` updated over the base's section of that name."""
    raw = {name: dict(values) for name, values in copy.deepcopy(dict(base)).items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def tiny_config(
    tmp: Path | None = None, *, base: Sections = TINY_LM, **sections: Mapping[str, Any]
) -> Config:
    """`base` with `sections` merged over it, writing to `tmp/run` (`tmp` None: `base`'s own
    run directory, or the schema's default); a `run.output_dir` in `sections` wins."""
    raw = merged(base)
    if tmp is not None:
        raw.setdefault("run", {})["output_dir"] = str(Path(tmp) / "run")
    return build_config(merged(raw, **sections))
