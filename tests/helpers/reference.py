"""The independent dense float64 attention reference used by kernel and CP parity tests.

`softmax(Q·Kᵀ·scale + M)·V` with M = −inf where `flashcp.mask_indices.to_dense` says masked, and its
gradients written out by hand, one head at a time. Fully masked rows give zero output and
gradients, and LSE −inf. `compare_attention` measures float32 results against it under the
rule of `bench.numerics`.
"""

from __future__ import annotations

import numpy as np

from bench import numerics
from flashcp import mask_indices

NAMES = ("out", "lse", "dq", "dk", "dv")


def compare_attention(
    got, want, *, n: int | None = None, label: str = ""
) -> list[numerics.Comparison]:
    """(out, lse, dq, dk, dv) of a float32 kernel vs the float64 reference, under the rule.

    n = the longest reduction (keys for out / dq, queries for dk / dv, head_dim for scores);
    pass it when `want` holds only some rows (a CP rank's shard of a longer sequence).
    out and lse are scaled by their own max |value|; the three gradients by the largest of
    them: dS = P ∘ (dP − δ) cancels (with one visible key, dq is exactly 0 but its float32
    rounding is that of dP ≈ δ), so each gradient's rounding is of the backward's size.
    """
    out, _, dq, dk, dv = (np.asarray(x) for x in want)
    n = max(out.shape[1], dk.shape[1], dk.shape[3]) if n is None else n
    grad_scale = max(float(np.max(np.abs(x))) if x.size else 0.0 for x in (dq, dk, dv))
    return [
        numerics.compare(a, b, n=n, scale=grad_scale if name[0] == "d" else None, what=label + name)
        for name, a, b in zip(NAMES, got, want, strict=True)
    ]


def dense_mask(idx, B: int, Sq: int, Sk: int, *, causal: bool) -> np.ndarray:
    """The boolean `[B, H_mask, Sq, Sk]` mask (True = masked) of `idx`; `idx` None: none, or
    the bottom-right-aligned causal one."""
    if idx is not None:
        return mask_indices.to_dense(idx, causal=causal, q_len=Sq)
    dense = np.zeros((B, 1, Sq, Sk), dtype=bool)
    if causal:
        dense |= np.arange(Sq)[:, None] < np.arange(Sk)[None, :] - (Sk - Sq)
    return dense


def dense_reference(q, k, v, dout, idx, *, causal, scale=None):
    """Return (out, lse, dq, dk, dv) in float64 for Paddle-layout inputs; `idx` may be None."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    dense = dense_mask(idx, B, Sq, Sk, causal=causal)
    hm = dense.shape[1]
    out = np.zeros((B, Sq, Hq, v.shape[-1]))
    lse = np.zeros((B, Hq, Sq))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for h in range(Hq):
            kv, m = h // g, mask_indices.mask_head_index(h, Hq, hm)
            s = np.where(dense[b, m], -np.inf, q[b, :, h] @ k[b, :, kv].T * scale)
            row_max = s.max(axis=1, keepdims=True)
            row_max = np.where(np.isfinite(row_max), row_max, 0.0)
            e = np.exp(s - row_max)
            total = e.sum(axis=1, keepdims=True)
            p = e / np.where(total > 0, total, 1.0)
            o = p @ v[b, :, kv]
            out[b, :, h] = o
            with np.errstate(divide="ignore"):
                lse[b, h] = (row_max + np.log(total))[:, 0]
            do = dout[b, :, h]
            dv[b, :, kv] += p.T @ do
            ds = p * (do @ v[b, :, kv].T - (do * o).sum(axis=1, keepdims=True))
            dq[b, :, h] = ds @ k[b, :, kv] * scale
            dk[b, :, kv] += ds.T @ q[b, :, h] * scale
    return out, lse, dq, dk, dv
