"""FA2/FA3/FA4 FlashMask on a real GPU vs the CPU reference and a dense oracle, forward and
backward, in bfloat16 and float16 with per-dtype tolerances (`helpers.gpu.TOLERANCE`), plus the
single-GPU context-parallel rehearsal.

Skipped on CPU-only machines: every test is marked `gpu` and skipped unless Paddle sees a CUDA
device. The CPU reference and the dense oracle both run in float32 on the dtype-rounded
inputs, so only the GPU kernel's own arithmetic is measured. FA3 runs only on SM90 (its kernels
exist for Hopper only), FA4 only where the CuTe kernels load (SM100); a call beyond FA4's
kernel limits (4-column masks, mask heads other than 1 or Hkv) must be refused by the
dispatch instead of reaching the kernel.

The CP rehearsal runs, on one GPU, exactly the kernel call a CP rank makes: the global mask
rebased for rank r of a world of 2 or 4 (`flashcp.cp.rebase_mask`), this rank's local queries
against ALL keys, `causal=False`, Sq != Sk - and checks it against the CPU reference of that
same call and against the rows of the whole-sequence attention at the rank's positions.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp import fa_dispatch, mask_families, mask_indices
from flashcp.attention.flashmask import flashmask_attention_with_version
from flashcp.attention.registry import make_assignment
from flashcp.cp.rebase import rebase_mask
from helpers.gpu import (
    GPU_DTYPES,
    SKIP_NO_GPU,
    allclose_args,
    capability_major,
    close,
    cpu_reference,
    has_cuda,
    rounded,
)
from helpers.reference import dense_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_cuda(), reason=SKIP_NO_GPU)]

FAMILIES = ["causal", "causal_document", "document", "sliding_window", "global_sliding_window"]


def _version_params() -> list:
    return [
        pytest.param(2, id="fa2"),
        pytest.param(
            3,
            id="fa3",
            marks=pytest.mark.skipif(
                has_cuda() and capability_major() != 9, reason="FA3 kernels exist for SM90 only"
            ),
        ),
        pytest.param(
            4,
            id="fa4",
            marks=pytest.mark.skipif(
                has_cuda() and not fa_dispatch.probe_fa4()[0], reason="FA4 needs SM100 + CuTe"
            ),
        ),
    ]


def dense_oracle(q, k, v, dout, idx, *, causal):
    """Dense float32 attention with Paddle autograd on CPU: (out, dq, dk, dv) numpy."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    dense = dense_mask(idx, B, Sq, Sk, causal=causal)
    heads = [mask_indices.mask_head_index(h, Hq, dense.shape[1]) for h in range(Hq)]
    cpu = paddle.CPUPlace()
    bias = np.where(dense[:, heads], -np.inf, 0.0).astype(np.float32)
    bias = paddle.to_tensor(bias, place=cpu)
    tq, tk, tv = (paddle.to_tensor(x, place=cpu, stop_gradient=False) for x in (q, k, v))
    kk = paddle.repeat_interleave(tk, g, axis=2).transpose([0, 2, 1, 3])
    vv = paddle.repeat_interleave(tv, g, axis=2).transpose([0, 2, 1, 3])
    s = paddle.matmul(tq.transpose([0, 2, 1, 3]), kk, transpose_y=True) * D**-0.5 + bias
    p = paddle.nn.functional.softmax(s, axis=-1)
    out = paddle.matmul(p, vv).transpose([0, 2, 1, 3])
    out.backward(paddle.to_tensor(dout, place=cpu))
    return out.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def _run_gpu(version, q, k, v, dout, idx, causal, dtype):
    gpu = paddle.CUDAPlace(0)
    gq, gk, gv = (paddle.to_tensor(x, place=gpu).astype(dtype) for x in (q, k, v))
    for t in (gq, gk, gv):
        t.stop_gradient = False
    gidx = None if idx is None else paddle.to_tensor(idx, dtype="int32", place=gpu)
    out, lse = flashmask_attention_with_version(
        gq, gk, gv, gidx, causal=causal, fa_version=version, return_lse=True
    )
    out.backward(paddle.to_tensor(dout, place=gpu).astype(dtype))
    as_np = [out, gq.grad, gk.grad, gv.grad]
    return [t.astype("float32").numpy() for t in as_np], lse.astype("float32").numpy()


def _inputs(seed, shapes, dtype):
    rng = np.random.default_rng(seed)
    return [rounded(rng.standard_normal(s).astype(np.float32), dtype) for s in shapes]


def _fa4_refuses(version, idx, hkv, d) -> bool:
    """For FA4, whether the dispatch must keep this call away from the kernel (and does)."""
    if version != 4:
        return False
    shape = None if idx is None else tuple(np.asarray(idx).shape)
    limit = fa_dispatch.fa4_call_limit(mask_shape=shape, num_kv_heads=hkv, head_dim=d)
    if limit is None:
        return False
    with pytest.raises(fa_dispatch.FlashAttnUnavailableError, match="beyond the SM100 CuTe"):
        fa_dispatch.explain_fa_version(
            4, fa4_available=True, block_mask_api=True, deterministic=False, head_dim=d,
            fa4_limit=limit,
        )  # fmt: skip
    return True


def _compare(version, B, S, Hq, Hkv, D, idx, causal, seed, dtype):
    if _fa4_refuses(version, idx, Hkv, D):
        return
    q, k, v, dout = _inputs(seed, [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)],
                            dtype)  # fmt: skip
    got, lse = _run_gpu(version, q, k, v, dout, idx, causal, dtype)
    out_c, lse_c, *grads_c = cpu_reference(q, k, v, dout, idx, causal=causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (out_c, *grads_c), strict=True):
        np.testing.assert_allclose(a, b, err_msg=f"{name} vs CPU reference", **allclose_args(dtype))
    finite = np.isfinite(lse_c)
    np.testing.assert_allclose(
        lse[..., :S][finite], lse_c[finite], err_msg="lse", **allclose_args(dtype)
    )
    oracle = dense_oracle(q, k, v, dout, idx, causal=causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, oracle, strict=True):
        np.testing.assert_allclose(a, b, err_msg=f"{name} vs dense oracle", **allclose_args(dtype))


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("family", FAMILIES)
def test_flashmask_families(version: int, family: str, dtype: str) -> None:
    mask = mask_families.FAMILIES[family](2, 256, 1, 3)
    _compare(version, 2, 256, 4, 2, 64, mask.indices, mask.causal, 1, dtype)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("hm", [2, 4])
def test_per_head_masks_gqa(version: int, hm: int, dtype: str) -> None:
    mask = mask_families.FAMILIES["sliding_window_per_head"](1, 192, hm, 5)
    _compare(version, 1, 192, 4, 2, 64, mask.indices, mask.causal, 2, dtype)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("causal", [False, True])
def test_no_mask(version: int, causal: bool, dtype: str) -> None:
    _compare(version, 2, 128, 4, 4, 64, None, causal, 3, dtype)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("family", ["causal", "causal_document", "sliding_window"])
def test_production_head_dim_128(version: int, family: str, dtype: str) -> None:
    """The shipped GLM recipes' head_dim (the tiny configs have 16): other kernel tiles, and
    the dispatch's deterministic FA3 rules depend on it (`flashcp.fa_dispatch`)."""
    mask = mask_families.FAMILIES[family](1, 256, 1, 4)
    _compare(version, 1, 256, 4, 2, 128, mask.indices, mask.causal, 4, dtype)


# ------------------------------------------------------------- single-GPU CP rehearsal

REHEARSAL_FAMILIES = ["causal", "causal_document", "share_question", "causal_blockwise",
                      "global_sliding_window"]  # fmt: skip


@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("family", REHEARSAL_FAMILIES)
@pytest.mark.parametrize("world", [2, 4])
def test_cp_rehearsal_one_gpu(version: int, family: str, world: int) -> None:
    """Every rank r of a world of `world`: rebased local mask, local Q vs all K, causal=False."""
    dtype, B, S, Hq, Hkv, D = "bfloat16", 1, 256, 4, 2, 64
    mask = mask_families.FAMILIES[family](B, S, 1, 11)
    q, k, v, dout = _inputs(7, [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)],
                            dtype)  # fmt: skip
    whole = cpu_reference(q, k, v, dout, mask.indices, causal=mask.causal)
    asg = make_assignment("dualchunk_allgather", world)
    outs = []
    for rank in range(world):
        pos = asg.positions(S, rank)
        local = rebase_mask(mask.indices, causal=mask.causal, assignment_or_positions=asg,
                            rank=rank)  # fmt: skip
        assert local.shape[2] == S and len(pos) == S // world  # Sq = S/world != Sk = S
        if _fa4_refuses(version, local, Hkv, D):
            continue
        lq, ldout = q[:, pos], dout[:, pos]
        got, _ = _run_gpu(version, lq, k, v, ldout, local, False, dtype)
        same_call = cpu_reference(lq, k, v, ldout, local, causal=False)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, (same_call[0], *same_call[2:]),
                              strict=True):  # fmt: skip
            np.testing.assert_allclose(
                a, b, err_msg=f"rank {rank}/{world} {name} vs CPU reference", **allclose_args(dtype)
            )
        # the local call IS the global attention's rows at this rank's positions
        np.testing.assert_allclose(
            got[0],
            whole[0][:, pos],
            err_msg=f"rank {rank}/{world} out vs whole sequence",
            **allclose_args(dtype),
        )
        np.testing.assert_allclose(
            got[1],
            whole[2][:, pos],
            err_msg=f"rank {rank}/{world} dq vs whole sequence",
            **allclose_args(dtype),
        )
        outs.append((pos, got[0]))
    if len(outs) >= 2:  # negative control: another rank's rows do not pass
        (_, out0), (pos1, _) = outs[0], outs[1]
        assert not close(out0, whole[0][:, pos1], dtype)
