"""The quick-start smoke job's dtype handling (issue 13 point 1): auto picks bfloat16 on GPU
and float32 on CPU, float32 on GPU is refused, and each dtype has its own tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from flashcp import smoke


@pytest.mark.parametrize(
    ("dtype", "device", "want"),
    [("auto", "gpu", "bfloat16"), ("auto", "cpu", "float32"), ("bfloat16", "gpu", "bfloat16"),
     ("float32", "cpu", "float32")],
)  # fmt: skip
def test_resolve_dtype(dtype: str, device: str, want: str) -> None:
    assert smoke.resolve_dtype(dtype, device) == want
    assert want in smoke.TOLERANCE


@pytest.mark.parametrize(
    ("dtype", "device", "needle"),
    [("float32", "gpu", "float16/bfloat16 only"), ("bfloat16", "cpu", "needs a GPU")],
)
def test_resolve_dtype_refuses(dtype: str, device: str, needle: str) -> None:
    with pytest.raises(SystemExit, match=needle):
        smoke.resolve_dtype(dtype, device)


def test_bf16_rounding_and_relative_error() -> None:
    x = np.array([1.0, 1.0 + 2.0**-10, 3.0], dtype=np.float32)
    rounded = smoke.as_dtype(x, "bfloat16")
    assert rounded[1] == 1.0  # below bf16 resolution (2^-7 at 1.0)
    np.testing.assert_array_equal(smoke.as_dtype(x, "float32"), x)
    assert smoke.relative_error(np.array([0.5]), np.array([0.0])) == 0.5  # floor of 1
    assert smoke.relative_error(np.array([9.0]), np.array([10.0])) == pytest.approx(0.1)
    # the bf16 tolerance admits a few bf16 ulps but not a wrong result
    assert smoke.TOLERANCE["bfloat16"] > 4 * 2.0**-8
    assert smoke.TOLERANCE["bfloat16"] < 0.1
