"""The long-context mechanisms the memory plan models, as one value: `Features`.

Issue 20 adds five mechanisms that change what a rank holds, each behind its own config key
(owned by the branch that builds it):

* activation offload — what a recomputed layer keeps for backward (its input; under
  `refined` also its attention output and LSE; the pipeline's stage inputs) moves to host
  memory after the layer's forward and comes back, one layer ahead, before its backward;
* the residual dtype — the residual stream (layer inputs and outputs, pipeline transfers) in
  float32 (today) or bfloat16;
* sequence tiling — a layer's token-wise parts run over tiles of `tile_tokens` local tokens
  under recompute, so its backward working set scales with the tile, not with S/cp;
* chunked attention — the attention runs over `query_chunk` local query rows at a time and
  gathers K/V (and reduce-scatters dK/dV) `kv_chunk` global keys at a time;
* gradient sharding (ZeRO-2) — float32 gradients reduce-scattered into their dp×cp shard as
  backward produces them, so no full-size float32 gradient outlives its bucket.

`features_of(cfg)` is what a config asks for — the one place that reads their keys;
`plan(cfg, features=...)` plans any other combination.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

ResidualDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class Features:
    """Which long-context mechanisms a plan assumes (all off: today's behaviour)."""

    offload_activations: bool = False
    """Kept layer inputs (and stage inputs, refined attention outputs) live in host memory
    between a layer's forward and its backward."""
    residual_dtype: ResidualDtype = "float32"
    """The residual stream's dtype: float32 (today) or bfloat16 (Megatron's default)."""
    tile_tokens: int = 0
    """Local tokens per tile of a layer's token-wise parts under recompute (0: untiled)."""
    query_chunk: int = 0
    """Local query rows per attention call (0: all local rows at once)."""
    kv_chunk: int = 0
    """Global keys gathered (and dK/dV reduce-scattered) at once (0: the whole sequence)."""
    shard_gradients: bool = False
    """ZeRO-2: float32 gradients kept only as this rank's dp×cp shard."""

    @property
    def any(self) -> bool:
        """Whether any mechanism is on."""
        return self != Features()

    def overrides(self) -> dict[str, Any]:
        """The non-default fields, by name (for reports)."""
        base = Features()
        return {k: v for k, v in self.__dict__.items() if getattr(base, k) != v}

    def with_(self, **changes: Any) -> Features:
        return replace(self, **changes)


AFTER = Features(
    offload_activations=True,
    residual_dtype="bfloat16",
    tile_tokens=4096,
    query_chunk=16384,
    kv_chunk=65536,
    shard_gradients=True,
)
"""Every issue-20 mechanism on, at the sizes the long-context page and configs assume."""


def features_of(cfg: Any) -> Features:
    """The mechanisms `cfg` turns on: `train.offload_activations`, `model.residual_dtype`,
    `model.tile_tokens`, `attention.query_chunk` / `attention.kv_chunk` and
    `parallel.shard_gradients`."""
    return Features(
        offload_activations=bool(cfg.train.offload_activations),
        residual_dtype=cfg.model.residual_dtype,
        tile_tokens=int(cfg.model.tile_tokens),
        query_chunk=int(cfg.attention.query_chunk),
        kv_chunk=int(cfg.attention.kv_chunk),
        shard_gradients=bool(cfg.parallel.shard_gradients),
    )
