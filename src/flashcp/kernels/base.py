"""The attention-backend contract every kernel family implements (CPU reference, FA2, FA3, FA4).

A backend is a stateless object. The context-parallel layer and the front door
(`flashcp.attention`) call it with a FlashAttention version resolved *once*, through
`flashcp.kernels.registry.get_backend(version, device)`, so forward and backward always run the
same family.

Layout (Paddle's): q `[B, Sq, Hq, D]`, k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]`, with
`Hq % Hkv == 0` (GQA / MQA). `startend_row_indices` is the FlashMask column mask
`[B, Hm, Sk, C]` int32 with `Hm in {1, Hkv, Hq}` (see `flashcp.mask_indices`), or None for "no mask"
(the `causal` flag still applies). Results: out `[B, Sq, Hq, Dv]` in q's dtype and lse
`[B, Hq, Sq]` (natural log, float32). Gradients: dq like q, dk/dv like k/v, with dk/dv summed
over the query heads of each KV group.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

Tensor = Any  # paddle.Tensor; kept loose so importing this module never imports paddle


@runtime_checkable
class AttentionBackend(Protocol):
    """What `registry.get_backend` returns. Keep this API stable: the CP layer depends on it."""

    name: str

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        startend_row_indices: Tensor | None,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        """Return `(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`."""
        ...

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        startend_row_indices: Tensor | None,
        dout: Tensor,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return `(dq, dk, dv)` for the forward that produced `out` and `lse`."""
        ...


def default_scale(head_dim: int) -> float:
    """FlashAttention's default softmax scale, `head_dim ** -0.5`."""
    return float(head_dim) ** -0.5


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """`softmax_scale`, or the default `head_dim ** -0.5` when it is None."""
    return default_scale(head_dim) if softmax_scale is None else float(softmax_scale)


def is_default_scale(softmax_scale: float | None, head_dim: int) -> bool:
    """Whether `softmax_scale` is None or equal (to float rounding) to the default."""
    if softmax_scale is None:
        return True
    return math.isclose(float(softmax_scale), default_scale(head_dim), rel_tol=1e-6)


def _flag_store() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(get, set) of `FLAGS_flash_attn_version`: Paddle's registry, else the environment.

    GPU builds register the flag (`paddle.get_flags` / `paddle.set_flags`); the CPU build does
    not (get_flags raises ValueError), and then the environment value is the one that counts
    (`flashcp.fa_dispatch` reads it there too).
    """
    import paddle

    from flashcp.fa_dispatch import FLAG_VERSION

    def env_get() -> Any:
        return os.environ.get(FLAG_VERSION)

    def env_set(value: Any) -> None:
        if value is None:
            os.environ.pop(FLAG_VERSION, None)
        else:
            os.environ[FLAG_VERSION] = str(value)

    def paddle_get() -> Any:
        return paddle.get_flags([FLAG_VERSION])[FLAG_VERSION]

    def paddle_set(value: Any) -> None:
        paddle.set_flags({FLAG_VERSION: int(value)})

    try:
        paddle_get()
    except (ValueError, KeyError):
        return env_get, env_set
    return paddle_get, paddle_set


@contextmanager
def flash_attn_version_flag(version: int) -> Iterator[None]:
    """Hold `FLAGS_flash_attn_version` at `version` for the duration of one op call.

    Paddle's FA2 ops branch on the flag internally (an older kernel revision refuses FlashMask
    when it says 3 on SM90), so when flashcp's effective version differs from the flag
    (deterministic head_dim > 128, a fallback, FA3 unavailable) the op must see the effective
    version. The previous value is restored afterwards, even when the op raises.
    """
    get, put = _flag_store()
    previous = get()
    if previous is not None and str(previous).strip() == str(version):
        yield
        return
    put(version)
    try:
        yield
    finally:
        put(previous)
