"""What the gpu tier shares: device probes, per-dtype tolerances and the CPU reference side.

GPU tests compare Paddle's FlashAttention kernels (half precision) with flashcp's float32 CPU
reference kernel run on the SAME half-precision-rounded inputs, so only the GPU kernel's own
arithmetic is measured. Tolerances are per dtype, elementwise `|got - want| <= tol * (1 +
|want|)`:

* bfloat16: unit roundoff 2^-8 ≈ 3.9e-3; the kernels round P (and dS in backward) to bf16
  before the second GEMMs and round each output once more, so a correct kernel stays within a
  few ulps; 2.5e-2 ≈ 6.4 ulps.
* float16: unit roundoff 2^-11 ≈ 4.9e-4, same argument: 1e-2 leaves room for the larger
  dynamic range of dK/dV sums while a wrong mask or a wrong shard (errors of order 1) fails.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

TOLERANCE: dict[str, float] = {"bfloat16": 2.5e-2, "float16": 1e-2, "float32": 1e-4}
"""float32 is for CPU dry runs of the GPU workers (same kernels family, different tiling)."""
GPU_DTYPES = ("bfloat16", "float16")

BF16_LOSS_RTOL = 2e-2
"""A bf16 (O1 autocast) training loss vs the float32 CPU golden: |bf16 - fp32| <= 2e-2 |fp32|.

Per step the bf16 run rounds every matmul input to 8 significant bits (relative 3.9e-3); the
mean token loss averages those errors, and 4 AdamW steps from the same initial weights only
let them drift a little. 2 % is ~5 bf16 ulps of the loss and well below how far the goldens
move from step 1 to step 4 (5.56 → 5.09 for the LM configs, 0.693 → 0.657 for DPO), so a run
that does not train, or trains on wrong masks, is caught."""

SKIP_NO_GPU = "needs a CUDA GPU and paddlepaddle-gpu (this Paddle is a CPU build or sees no GPU)"


@cache
def gpu_count() -> int:
    import paddle

    if not paddle.is_compiled_with_cuda():
        return 0
    return int(paddle.device.cuda.device_count())


def has_cuda() -> bool:
    return gpu_count() > 0


def capability_major() -> int:
    import paddle

    return int(paddle.device.cuda.get_device_capability()[0]) if has_cuda() else 0


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` rounded to `dtype` (on CPU) and back to float32."""
    import paddle

    t = paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32), place=paddle.CPUPlace())
    return t.astype(dtype).astype("float32").numpy()


def allclose_args(dtype: str) -> dict[str, Any]:
    """`dtype`'s comparison for `np.testing.assert_allclose` / `np.allclose`: elementwise
    |got - want| <= tol (1 + |want|), and a NaN anywhere fails."""
    tol = TOLERANCE[dtype]
    return {"atol": tol, "rtol": tol, "equal_nan": False}


def close(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    """Within `dtype`'s tolerance, same shape (negative controls assert it is not)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return got.shape == want.shape and bool(np.allclose(got, want, **allclose_args(dtype)))


def cpu_reference(q, k, v, dout, idx, *, causal: bool):
    """flashcp's float32 CPU kernel: (out, lse, dq, dk, dv) as numpy, for float32 inputs."""
    from flashcp.kernels import CpuReferenceBackend

    cpu = CpuReferenceBackend()
    out, lse = cpu.forward(q, k, v, idx, causal=causal, softmax_scale=None)
    dq, dk, dv = cpu.backward(q, k, v, out, lse, idx, dout, causal=causal, softmax_scale=None)
    return out, lse, dq, dk, dv
