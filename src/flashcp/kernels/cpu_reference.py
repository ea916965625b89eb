"""The CPU reference backend: exact, tiled FlashMask attention in numpy, for any FA version.

On a CPU device the registry maps every FlashAttention version to this backend (the version
is still resolved and recorded, so a bad flag fails identically everywhere). It is also the
numerical reference the GPU backends are tested against.

Precision: float32 inputs compute and accumulate in float32; float64 inputs in float64. The
LSE comes back as float32 for float32 inputs (Paddle's convention) and float64 for float64
inputs so a float64 run stays exact end to end.

Fully masked query rows give out = 0 and LSE = -inf, and zero gradients. (Paddle's CUDA
FlashAttention kernels write +inf there instead; both mean "empty row".)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.kernels.base import resolve_scale
from flashcp.kernels.cpu_backward import flash_backward
from flashcp.kernels.cpu_forward import flash_forward
from flashcp.kernels.cpu_plan import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    DEFAULT_MAX_MERGE_COLS,
    TilePlan,
)

CPU_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy"):
        return np.asarray(x.numpy())
    raise TypeError(f"{name} must be a paddle.Tensor or numpy array, got {type(x).__name__}")


def _float_inputs(named: dict[str, Any]) -> dict[str, np.ndarray]:
    arrays = {name: _numpy(x, name) for name, x in named.items()}
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in CPU_DTYPES:
        shown = ", ".join(f"{n}={a.dtype}" for n, a in arrays.items())
        raise TypeError(
            f"the CPU reference kernel takes float32 or float64 tensors of one dtype, got {shown}"
        )
    return arrays


def _to_paddle(arr: np.ndarray, like: Any) -> Any:
    """A paddle Tensor on `like`'s place (numpy in, numpy out when `like` is numpy)."""
    if isinstance(like, np.ndarray):
        return arr
    import paddle

    return paddle.to_tensor(arr, place=like.place)


class CpuReferenceBackend:
    """Tiled online-softmax FlashMask attention on CPU (see `flashcp.kernels.cpu_plan`).

    `block_q`/`block_k` are the tile sizes used for mask classification and skipping;
    `max_merge_cols` caps how many key columns of adjacent non-masked tiles go into one
    matmul (bounding scratch memory to `heads x block_q x max_merge_cols`).
    """

    name = "cpu-reference"

    def __init__(
        self,
        *,
        block_q: int = DEFAULT_BLOCK_Q,
        block_k: int = DEFAULT_BLOCK_K,
        max_merge_cols: int = DEFAULT_MAX_MERGE_COLS,
    ) -> None:
        self.block_q = block_q
        self.block_k = block_k
        self.max_merge_cols = max_merge_cols

    def __repr__(self) -> str:
        return (
            f"CpuReferenceBackend(block_q={self.block_q}, block_k={self.block_k}, "
            f"max_merge_cols={self.max_merge_cols})"
        )

    def plan(
        self, startend_row_indices: Any, *, batch: int, q_len: int, k_len: int, causal: bool
    ) -> TilePlan:
        """The tiling plan for one call (exposed for benchmarks and tests)."""
        idx = None if startend_row_indices is None else _numpy(startend_row_indices, "mask")
        return TilePlan(
            idx,
            batch=batch,
            q_len=q_len,
            k_len=k_len,
            causal=causal,
            block_q=self.block_q,
            block_k=self.block_k,
            max_merge_cols=self.max_merge_cols,
        )

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        startend_row_indices: Any,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Any, Any]:
        """`(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`; paddle in, paddle out (or numpy/numpy)."""
        a = _float_inputs({"q": q, "k": k, "v": v})
        qn, kn, vn = a["q"], a["k"], a["v"]
        plan = self.plan(
            startend_row_indices,
            batch=qn.shape[0],
            q_len=qn.shape[1],
            k_len=kn.shape[1],
            causal=causal,
        )
        out, lse = flash_forward(qn, kn, vn, plan, resolve_scale(softmax_scale, qn.shape[-1]))
        return _to_paddle(out, q), _to_paddle(lse, q)

    def backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        startend_row_indices: Any,
        dout: Any,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Any, Any, Any]:
        """`(dq, dk, dv)`, dk/dv summed over each KV group's query heads."""
        a = _float_inputs({"q": q, "k": k, "v": v, "out": out, "dout": dout})
        qn = a["q"]
        lse_n = _numpy(lse, "lse").astype(qn.dtype, copy=False)
        plan = self.plan(
            startend_row_indices,
            batch=qn.shape[0],
            q_len=qn.shape[1],
            k_len=a["k"].shape[1],
            causal=causal,
        )
        dq, dk, dv = flash_backward(
            qn,
            a["k"],
            a["v"],
            a["out"],
            lse_n,
            a["dout"],
            plan,
            resolve_scale(softmax_scale, qn.shape[-1]),
        )
        return _to_paddle(dq, q), _to_paddle(dk, k), _to_paddle(dv, v)
