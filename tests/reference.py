"""The independent dense float64 attention reference used by kernel and CP parity tests.

`softmax(Q·Kᵀ·scale + M)·V` with M = −inf where `flashcp.masks.to_dense` says masked, and its
gradients written out by hand, one head at a time. Fully masked rows give zero output and
gradients, and LSE −inf.
"""

from __future__ import annotations

import numpy as np

from flashcp import masks


def dense_reference(q, k, v, dout, idx, *, causal, scale=None):
    """Return (out, lse, dq, dk, dv) in float64 for Paddle-layout inputs; `idx` may be None."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    if idx is None:
        dense = np.zeros((B, 1, Sq, Sk), dtype=bool)
        if causal:
            dense |= np.arange(Sq)[:, None] < np.arange(Sk)[None, :] - (Sk - Sq)
    else:
        dense = masks.to_dense(idx, causal=causal, q_len=Sq)
    hm = dense.shape[1]
    out = np.zeros((B, Sq, Hq, v.shape[-1]))
    lse = np.zeros((B, Hq, Sq))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for h in range(Hq):
            kv, m = h // g, masks.mask_head_index(h, Hq, hm)
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
