"""CPU reference FlashMask forward: tiled attention with an online softmax.

Element-wise work in numpy, matrix multiplies through `flashcp.kernels.numpy_bridge` (Paddle's CPU
GEMM on the same buffers).

For each query block the kernel walks the merged key segments of the tiling plan, keeping a
running row maximum `m`, a running sum `l` and an unnormalised accumulator; the output is
`acc / l` and the log-sum-exp is `m + log(l)` (natural log, scores already scaled).

V carries an extra column of ones (`heads_first_augmented`), so each tile's `P [V, 1]` gives
`P V` and the row sums of P in one matmul: the accumulator's last column is the running sum
`l`, rescaled and summed with the rest of it.

Fully masked rows (every key masked) give output 0 and LSE -inf. The guard `m_safe` (0 where
the running max is still -inf) keeps `exp(-inf - -inf)` out of the arithmetic, so no NaN
appears anywhere. The backward maps LSE -inf back to P = 0 the same way.
"""

from __future__ import annotations

import numpy as np

from flashcp.kernels.cpu_plan import TilePlan, head_units, heads_first, heads_first_augmented
from flashcp.kernels.numpy_bridge import matmul


def flash_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    plan: TilePlan,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention forward on numpy arrays in Paddle layout.

    q `[B, Sq, Hq, D]`, k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]`, all of one float dtype
    (float32 computes in float32, float64 in float64). Returns out `[B, Sq, Hq, Dv]` and
    lse `[B, Hq, Sq]` in the same dtype.
    """
    dtype = q.dtype
    B, Sq, Hq, _ = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    qh = heads_first(q, scale)  # scores come out of the matmul already scaled
    kh = heads_first(k)
    vh = heads_first_augmented(v, 1)  # [V, 1]: P [V, 1] = [P V, rowsum P]
    out_h = np.zeros((B, Hq, Sq, Dv), dtype=dtype)
    lse = np.full((B, Hq, Sq), -np.inf, dtype=dtype)
    neg_inf = dtype.type(-np.inf)

    for b in range(B):
        for unit in head_units(Hq, Hkv, plan.mask_heads):
            qu = unit.q_view(qh[b])  # [n_kv, g, Sq, D]
            ku = unit.kv_view(kh[b])  # [n_kv, Sk, D]
            vu = unit.kv_view(vh[b])  # [n_kv, Sk, Dv + 1]
            ou = unit.q_view(out_h[b])
            lu = unit.q_view(lse[b])
            n_kv, g = unit.n_kv, unit.group
            for i in range(plan.num_q_blocks):
                segments = plan.segments(b, unit.mask_head, i)
                if not segments:
                    continue  # fully masked block: out 0, lse -inf (already)
                r0, r1 = plan.rows(i)
                rows = r1 - r0
                q2 = qu[:, :, r0:r1].reshape(n_kv, g * rows, -1)
                m_run = acc = None  # acc [..., Dv] is the running sum l
                for seg in segments:
                    s = matmul(q2, ku[:, seg.k0 : seg.k1], transpose_b=True)
                    if seg.partial:
                        s4 = s.reshape(n_kv, g, rows, -1)
                        plan.apply_mask(s4, b, unit.mask_head, r0, r1, seg)
                    m_new = s.max(axis=-1, keepdims=True)
                    if m_run is not None:
                        np.maximum(m_new, m_run, out=m_new)
                    m_safe = np.where(m_new == neg_inf, 0, m_new).astype(dtype, copy=False)
                    s -= m_safe
                    np.exp(s, out=s)  # s is now P (unnormalised)
                    pv = matmul(s, vu[:, seg.k0 : seg.k1])  # [P V, rowsum P]
                    if acc is None:
                        acc = pv
                    else:
                        acc *= np.exp(m_run - m_safe)
                        acc += pv
                    m_run = m_new
                    del s  # freed before the next segment's scores
                assert m_run is not None and acc is not None
                l_run = acc[..., Dv:]
                nonzero = l_run > 0
                l_div = np.where(nonzero, l_run, 1)
                m_fin = np.where(m_run == neg_inf, 0, m_run)
                lse_blk = np.where(nonzero, m_fin + np.log(l_div), neg_inf)
                ou[:, :, r0:r1] = (acc[..., :Dv] / l_div).reshape(n_kv, g, rows, Dv)
                lu[:, :, r0:r1] = lse_blk.reshape(n_kv, g, rows)

    return np.ascontiguousarray(out_h.transpose(0, 2, 1, 3)), lse
