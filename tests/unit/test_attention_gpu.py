"""FA2/FA3 (and FA4 when present) FlashMask on a real GPU vs the CPU reference and a dense
oracle, forward and backward, in bfloat16 (tolerance 2.5e-2).

Skipped on CPU-only machines: every test is marked `gpu` and skipped unless Paddle sees a CUDA
device. The CPU reference and the dense oracle both run in float32 on the bf16-rounded
inputs, so only the GPU kernel's own bf16 arithmetic is being measured.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp import dispatch, masks
from flashcp.attention import flashmask_attention_with_version
from flashcp.kernels import CpuReferenceBackend


def _has_cuda() -> bool:
    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def _capability_major() -> int:
    return paddle.device.cuda.get_device_capability()[0] if _has_cuda() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _has_cuda(), reason="needs a CUDA GPU and paddlepaddle-gpu (this Paddle is CPU-only)"
    ),
]

TOL = 2.5e-2
FAMILIES = ["causal", "causal_document", "document", "sliding_window", "global_sliding_window"]


def _version_params() -> list:
    return [
        pytest.param(2, id="fa2"),
        pytest.param(
            3,
            id="fa3",
            marks=pytest.mark.skipif(
                _has_cuda() and _capability_major() < 9, reason="FA3 needs SM90+"
            ),
        ),
        pytest.param(
            4,
            id="fa4",
            marks=pytest.mark.skipif(
                _has_cuda() and not dispatch.probe_fa4()[0], reason="FA4 needs SM100 + CuTe"
            ),
        ),
    ]


def dense_oracle(q, k, v, dout, idx, *, causal):
    """Dense float32 attention with Paddle autograd on CPU: (out, dq, dk, dv) numpy."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if idx is None:
        dense = np.zeros((B, 1, Sq, Sk), dtype=bool)
        if causal:
            dense |= np.arange(Sq)[:, None] < np.arange(Sk)[None, :] - (Sk - Sq)
    else:
        dense = masks.to_dense(idx, causal=causal, q_len=Sq)
    heads = [masks.mask_head_index(h, Hq, dense.shape[1]) for h in range(Hq)]
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


def _bf16_round(x: np.ndarray) -> np.ndarray:
    t = paddle.to_tensor(x, place=paddle.CPUPlace())
    return t.astype("bfloat16").astype("float32").numpy()


def _run_gpu(version, q, k, v, dout, idx, causal):
    gq, gk, gv = (
        paddle.to_tensor(x, place=paddle.CUDAPlace(0)).astype("bfloat16") for x in (q, k, v)
    )
    for t in (gq, gk, gv):
        t.stop_gradient = False
    gidx = None if idx is None else paddle.to_tensor(idx, dtype="int32", place=paddle.CUDAPlace(0))
    out, lse = flashmask_attention_with_version(
        gq, gk, gv, gidx, causal=causal, fa_version=version, return_lse=True
    )
    out.backward(paddle.to_tensor(dout, place=paddle.CUDAPlace(0)).astype("bfloat16"))
    as_np = [out, gq.grad, gk.grad, gv.grad]
    return [t.astype("float32").numpy() for t in as_np], lse.astype("float32").numpy()


def _compare(version, B, S, Hq, Hkv, D, idx, causal, seed):
    rng = np.random.default_rng(seed)
    q = _bf16_round(rng.standard_normal((B, S, Hq, D)).astype(np.float32))
    k = _bf16_round(rng.standard_normal((B, S, Hkv, D)).astype(np.float32))
    v = _bf16_round(rng.standard_normal((B, S, Hkv, D)).astype(np.float32))
    dout = _bf16_round(rng.standard_normal((B, S, Hq, D)).astype(np.float32))
    got, lse = _run_gpu(version, q, k, v, dout, idx, causal)
    cpu = CpuReferenceBackend()
    out_c, lse_c = cpu.forward(q, k, v, idx, causal=causal, softmax_scale=None)
    grads_c = cpu.backward(q, k, v, out_c, lse_c, idx, dout, causal=causal, softmax_scale=None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (out_c, *grads_c), strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{name} vs CPU reference")
    finite = np.isfinite(lse_c)
    np.testing.assert_allclose(lse[..., :S][finite], lse_c[finite], atol=TOL, rtol=TOL)
    for name, a, b in zip(
        ("out", "dq", "dk", "dv"), got, dense_oracle(q, k, v, dout, idx, causal=causal), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{name} vs dense oracle")


@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("family", FAMILIES)
def test_flashmask_families(version: int, family: str) -> None:
    mask = masks.FAMILIES[family](2, 256, 1, 3)
    _compare(version, 2, 256, 4, 2, 64, mask.indices, mask.causal, seed=1)


@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("hm", [2, 4])
def test_per_head_masks_gqa(version: int, hm: int) -> None:
    mask = masks.FAMILIES["sliding_window_per_head"](1, 192, hm, 5)
    _compare(version, 1, 192, 4, 2, 64, mask.indices, mask.causal, seed=2)


@pytest.mark.parametrize("version", _version_params())
@pytest.mark.parametrize("causal", [False, True])
def test_no_mask(version: int, causal: bool) -> None:
    _compare(version, 2, 128, 4, 4, 64, None, causal, seed=3)
