"""The planner's unit (`flashcp.plan.counts`): per-token counts by dtype class, and each class's
byte size under a run's dtypes, against Paddle's own element sizes and the models' choices."""

from __future__ import annotations

import itertools

import paddle
import pytest

from flashcp.models import cpu_elementwise
from flashcp.plan.counts import Counts, Dtypes

DTYPES = ("float32", "bfloat16")


def _size(dtype: str) -> int:
    return paddle.zeros([1], dtype=dtype).element_size()


@pytest.mark.parametrize(
    ("compute", "param", "device", "residual"),
    list(itertools.product(DTYPES, DTYPES, ("cpu", "gpu"), DTYPES)),
)
def test_class_sizes_are_the_tensors_element_sizes(
    compute: str, param: str, device: str, residual: str
) -> None:
    """compute → ``c``; storage → ``param``; the routed experts' rows in the stored weights'
    dtype on GPU (the grouped GEMM), float32 on CPU; the stream between layers in
    `model.residual_dtype`; inside a layer the residual stream is float32."""
    dt = Dtypes.of(compute, param, device, residual)
    assert (dt.c, dt.param, dt.res, dt.boundary) == (
        _size(compute), _size(param), 4, _size(residual)
    )
    assert dt.experts == (_size(param) if device == "gpu" else 4)
    assert dt.gpu == (device == "gpu")
    assert dt.autocast == (compute == "bfloat16")
    assert dt.upcast == (param == "bfloat16" and compute == "float32")


@pytest.mark.parametrize("compute", DTYPES)
@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_numpy_elementwise_is_where_the_models_take_the_numpy_path(
    compute: str, device: str
) -> None:
    """The planner's CPU float32 rule is `cpu_elementwise.applies` on the activations a run
    computes with (a GPU run's are never on a CPU place); only RMSNorm has a numpy twin."""
    dt = Dtypes.of(compute, "float32", device)
    activation = paddle.zeros([2, 3], dtype=compute)
    assert dt.numpy_elementwise == (device == "cpu" and cpu_elementwise.applies(activation))
    assert dt.numpy_rmsnorm("rms") == dt.numpy_elementwise
    assert not dt.numpy_rmsnorm("layer")


def test_unknown_residual_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"residual dtype 'float16': use one of"):
        Dtypes.of("float32", "float32", "cpu", "float16")


def test_counts_add_by_class_and_price_each_class() -> None:
    a = Counts().add("norm", "f", 1).add("q", "c", 8).add("stream", "b", 2)
    b = Counts().add("rows", "e", 3).add("h", "res", 5)
    total = a + b
    assert (total.f, total.res, total.c, total.e, total.b) == (1, 5, 8, 3, 2)
    assert [p[0] for p in total.parts] == ["norm", "q", "stream", "rows", "h"]
    assert (a.e, a.res, len(a.parts)) == (0, 0, 3)  # `+` leaves its operands alone
    gpu = Dtypes.of("bfloat16", "bfloat16", "gpu", "bfloat16")
    assert total.bytes(gpu) == 1 * 4 + 5 * 4 + 8 * 2 + 3 * 2 + 2 * 2
    cpu = Dtypes.of("float32", "float32")
    assert total.bytes(cpu) == 4 * (1 + 5 + 8 + 3 + 2)
