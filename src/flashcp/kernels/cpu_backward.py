"""CPU reference FlashMask backward: FlashAttention-2 style, recomputing P per tile from LSE.

Element-wise work in numpy, matrix multiplies through `flashcp.kernels.numpy_bridge`.

With scaled scores S = scale * Q Kᵀ (masked entries -inf), P = exp(S - LSE) and
D = rowsum(dO ∘ O), the gradients are

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP - D),   dQ = scale * dS K,   dK = scale * dSᵀ Q.

The two subtractions ride in the matmuls: Q carries an extra column -LSE and dO one of -D,
against an extra column of ones on K and V (`heads_first_augmented`), so `[Qs, -LSE] [K, 1]ᵀ`
is S - LSE and `[dO, -D] [V, 1]ᵀ` is dP - D with no element-wise pass over the tile; the
products with Q, dO and K as right-hand operands (dK, dV, dQ) use plain copies (V has none).

dK and dV are accumulated transposed, `[D, Sk]` per KV head: `(dSᵀ Qs)ᵀ = Qsᵀ dS` transposes
the thin `[rows, D]` operand, not the score tile, which Paddle's CPU GEMM does about a third
faster (its transposed-A product over a wide tile is the slowest of the kernel's GEMMs).

The same tiling plan as the forward is used (masked tiles skipped, exact mask on partial
tiles only). Query heads of a KV group are stacked into one matmul, so dK/dV come out already
summed over the group. Rows with LSE -inf (fully masked) use LSE 0 instead: all their scores
are -inf, so P = 0 and every gradient contribution is exactly 0, never NaN.
"""

from __future__ import annotations

import numpy as np

from flashcp.kernels.cpu_plan import TilePlan, head_units, heads_first, heads_first_augmented
from flashcp.kernels.numpy_bridge import matmul


def flash_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dout: np.ndarray,
    plan: TilePlan,
    scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients `(dq, dk, dv)` in Paddle layout, same dtype as q.

    Shapes as in `flash_forward`; `lse` is `[B, Hq, Sq]` from that forward, `dout` is like
    `out`.
    """
    dtype = q.dtype
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    qh = heads_first(q, scale)  # scaled Q: S = Qs Kᵀ and dK = dSᵀ Qs
    kh = heads_first(k)
    doh = heads_first(dout)
    delta = np.einsum("bshd,bshd->bhs", dout, out, dtype=dtype)  # D = rowsum(dO ∘ O)
    lse_safe = np.where(np.isfinite(lse), lse, 0).astype(dtype, copy=False)
    ka = heads_first_augmented(k, 1)  # [K, 1]
    va = heads_first_augmented(v, 1)  # [V, 1]
    dqh = np.zeros((B, Hq, Sq, D), dtype=dtype)
    dkh = np.zeros((B, Hkv, D, Sk), dtype=dtype)  # dKᵀ, dVᵀ: see the module docstring
    dvh = np.zeros((B, Hkv, Dv, Sk), dtype=dtype)
    scale_t = dtype.type(scale)

    for b in range(B):
        for unit in head_units(Hq, Hkv, plan.mask_heads):
            qu = unit.q_view(qh[b])
            dou = unit.q_view(doh[b])
            lseu = unit.q_view(lse_safe[b])
            deltau = unit.q_view(delta[b])
            dqu = unit.q_view(dqh[b])
            ku = unit.kv_view(kh[b])
            kau = unit.kv_view(ka[b])
            vau = unit.kv_view(va[b])
            dku = unit.kv_view(dkh[b])
            dvu = unit.kv_view(dvh[b])
            n_kv, g = unit.n_kv, unit.group
            for i in range(plan.num_q_blocks):
                segments = plan.segments(b, unit.mask_head, i)
                if not segments:
                    continue
                r0, r1 = plan.rows(i)
                rows = r1 - r0
                q2 = qu[:, :, r0:r1].reshape(n_kv, g * rows, D)
                do2 = dou[:, :, r0:r1].reshape(n_kv, g * rows, Dv)
                qa2 = np.empty((n_kv, g * rows, D + 1), dtype=dtype)  # [Qs, -LSE]
                qa2[..., :D] = q2
                np.negative(lseu[:, :, r0:r1].reshape(n_kv, g * rows), out=qa2[..., D])
                doa2 = np.empty((n_kv, g * rows, Dv + 1), dtype=dtype)  # [dO, -D]
                doa2[..., :Dv] = do2
                np.negative(deltau[:, :, r0:r1].reshape(n_kv, g * rows), out=doa2[..., Dv])
                dq2 = np.zeros((n_kv, g * rows, D), dtype=dtype)
                for seg in segments:
                    p = matmul(qa2, kau[:, seg.k0 : seg.k1], transpose_b=True)  # S - LSE
                    if seg.partial:
                        p4 = p.reshape(n_kv, g, rows, -1)
                        plan.apply_mask(p4, b, unit.mask_head, r0, r1, seg)
                    np.exp(p, out=p)  # P, exactly 0 on masked entries
                    dvu[..., seg.k0 : seg.k1] += matmul(do2, p, transpose_a=True)  # (Pᵀ dO)ᵀ
                    ds = matmul(doa2, vau[:, seg.k0 : seg.k1], transpose_b=True)  # dP - D
                    ds *= p  # dS
                    dq2 += matmul(ds, ku[:, seg.k0 : seg.k1])
                    dku[..., seg.k0 : seg.k1] += matmul(q2, ds, transpose_a=True)  # (dSᵀ Qs)ᵀ
                    del p, ds  # freed before the next segment's: two tiles alive, not three
                dq2 *= scale_t
                dqu[:, :, r0:r1] = dq2.reshape(n_kv, g, rows, D)

    return (
        np.ascontiguousarray(dqh.transpose(0, 2, 1, 3)),
        np.ascontiguousarray(dkh.transpose(0, 3, 1, 2)),
        np.ascontiguousarray(dvh.transpose(0, 3, 1, 2)),
    )
