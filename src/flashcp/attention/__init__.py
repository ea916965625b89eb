"""Attention: one interface, its implementations, and the one registry of CP modes.

* `flashcp.attention.interface`: `AttentionImpl` (plan → forward → backward, and `apply`, one
  PyLayer for every implementation) and `AttentionPlan`.
* `flashcp.attention.context`: `AttentionContext`, what every layer of a forward pass shares
  (the global mask, the CP group and mode), and the plan cache of a micro-batch.
* `flashcp.attention.registry`: THE table of CP modes (name → chunks per rank, layout,
  implementation); the model asks it which implementation runs for a context.
* `flashcp.attention.local`: the whole sequence on this rank (no CP);
  `flashcp.attention.flashmask`: its public front door, `flashmask_attention`.
* `flashcp.attention.allgather_kv`: all-gather-KV context parallelism (Llama 3 / PaddleFleet
  style) over a CP group; its public function is `flashmask_attention_cp`.

This package module imports nothing when imported: the config layer reads
`flashcp.attention.registry` without paddle. Its public names — `flashmask_attention`,
`flashmask_attention_with_version`, `flashmask_attention_cp`, `AttentionContext` — load from
their modules on first use (PEP 562; `docs/api.md`).
"""

from __future__ import annotations

import importlib
from typing import Any

PUBLIC: dict[str, str] = {
    "flashmask_attention": "flashcp.attention.flashmask",
    "flashmask_attention_with_version": "flashcp.attention.flashmask",
    "flashmask_attention_cp": "flashcp.attention.allgather_kv",
    "AttentionContext": "flashcp.attention.context",
}
"""Public name → its defining module."""

__all__ = list(PUBLIC)


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'flashcp.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
