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
    tile_tokens=1024,
    query_chunk=16384,
    kv_chunk=32768,
    shard_gradients=True,
)
"""Every issue-20 mechanism on, at the sizes the long-context page and configs assume: tiles
of 1024 tokens and key chunks of 32,768 keep GLM-4-9B's full fine-tune at 4,194,304 tokens
within an H20's 96 GiB less its 5 % headroom (tiles of 4096 and key chunks of 65,536 plan
0.4 GiB over it, with the GPU kernels' own backward buffers counted)."""

KEYS = {
    "offload_activations": "train.offload_activations",
    "residual_dtype": "model.residual_dtype",
    "tile_tokens": "model.tile_tokens",
    "query_chunk": "attention.query_chunk",
    "kv_chunk": "attention.kv_chunk",
    "shard_gradients": "parallel.shard_gradients",
}
"""Each mechanism's config key (`features_of` reads them)."""


def as_overrides(f: Features) -> list[str]:
    """`f`'s non-default mechanisms as config overrides (`key=value`), e.g. for a variant."""
    return [f"{KEYS[k]}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in f.overrides().items()]  # fmt: skip


def features_of(cfg: Any) -> Features:
    """The mechanisms `cfg` turns on, read from their keys (`KEYS`: `train.offload_activations`,
    `model.residual_dtype`, `model.tile_tokens`, `attention.query_chunk` /
    `attention.kv_chunk` and `parallel.shard_gradients`)."""
    base = Features()
    values = {}
    for name, key in KEYS.items():
        section, attr = key.split(".")
        values[name] = type(getattr(base, name))(getattr(getattr(cfg, section), attr))
    return Features(**values)
