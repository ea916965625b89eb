"""bf16 routed experts on Paddle's grouped GEMM (issue 21 items 1 and 4).

With bf16-stored weights on a GPU the MoE layer casts its rows to bf16 before dispatch
(`GroupedExperts.row_dtype`), so the expert buffers and the all-to-all bytes are half of
float32 rows' — and the result must be the same as sending float32 rows that the GEMM rounds
itself. No GPU here: Paddle registers `batched_gemm` for GPU only, so a fake with the op's
layout (`paddle/phi/kernels/legacy/gpu/batched_gemm.cu`, as `flashcp.models.grouped_matmul`
calls it: row blocks of `lhs` per batch times `rhs[e]`, `trans_rhs` for the input gradient,
`trans_lhs` for the per-expert weight gradient `[E, K, N]`; computed in the inputs' dtype:
float32 accumulation, one rounding of the output) stands in for it, the layer is told it runs
on the grouped GEMM (`experts.on_grouped_gemm`) and the dispatch runs its Paddle bodies (not
CPU float32's numpy ones), and `paddle.where`, whose CPU kernel lacks bf16, picks through
float32 (exact). Checked:

* the bf16 GEMM case itself, weight gradients included (an expert without rows gets exactly
  zero), against a float64 reference on the bf16 inputs; the gpu-marked twin runs the real
  kernel against the CPU float32 groups path;
* the MoE layer (and the expert-parallel path over a one-rank group): rows cast before
  dispatch give BITWISE the outputs and every gradient of float32 rows — negative control: the
  naive cast (the tokens cast before the permute, so each token's k row gradients are summed
  in bf16) changes the input gradient — while the rows sent are bf16, half the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle
import paddle.incubate.nn.functional as incubate_f
import pytest

from flashcp.distributed import Exchange
from flashcp.distributed.collectives import nbytes
from flashcp.distributed.groups import NamedGroup
from flashcp.models import expert_parallel, experts, moe, moe_dispatch, preset
from flashcp.models.experts import GroupedExperts, plan_layout
from flashcp.models.grouped_matmul import batched_gemm_matmul
from flashcp.models.moe import MoE
from flashcp.models.moe_dispatch import build_dispatch, combine, permute
from helpers.gpu import TOLERANCE, allclose_args, close, rounded

H = 32

Calls = list[tuple[bool, bool, str]]


def fake_batched_gemm(lhs, rhs, batch_sizes, trans_lhs=False, trans_rhs=False, *, calls: Calls):  # type: ignore[no-untyped-def]
    """Paddle's `batched_gemm` on CPU (module docstring); records (trans_lhs, trans_rhs, dtype)."""
    calls.append((bool(trans_lhs), bool(trans_rhs), str(lhs.dtype)))
    assert lhs.dtype == rhs.dtype, (lhs.dtype, rhs.dtype)
    a, b = lhs.astype("float32").numpy(), rhs.astype("float32").numpy()
    starts = np.concatenate([[0], np.cumsum(batch_sizes)]).astype(int)
    parts = []
    for e in range(len(batch_sizes)):
        rows = a[starts[e] : starts[e + 1]]
        if trans_lhs:  # x_e^T @ dy_e: rhs is row-blocked like lhs
            parts.append(rows.T @ b[starts[e] : starts[e + 1]])
        else:
            parts.append(rows @ (b[e].T if trans_rhs else b[e]))
    out = np.stack(parts) if trans_lhs else np.concatenate(parts, axis=0)
    return paddle.to_tensor(out.astype(np.float32)).astype(lhs.dtype)


@pytest.fixture
def grouped_gemm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """The fake GEMM in place of Paddle's, and the layer routed to it; yields its calls."""
    calls: Calls = []

    def fake(*args: Any, **kwargs: Any) -> paddle.Tensor:
        return fake_batched_gemm(*args, **kwargs, calls=calls)

    real_where = paddle.where

    def where(cond: paddle.Tensor, x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
        # Paddle's CPU `where` has no bf16 kernel (its GPU one does): widen, pick, narrow —
        # exact, a bf16 value round-trips float32 unchanged
        if x.dtype == paddle.bfloat16:
            return real_where(cond, x.astype("float32"), y.astype("float32")).astype(x.dtype)
        return real_where(cond, x, y)

    monkeypatch.setattr(incubate_f, "batched_gemm", fake)
    monkeypatch.setattr(paddle, "where", where)
    monkeypatch.setattr(experts, "on_grouped_gemm", lambda x: True)
    # as on a GPU, the permute and the combine run their Paddle bodies (the numpy ones are
    # CPU float32's: float32 rows there would be summed by other code than bf16 rows)
    monkeypatch.setattr(moe_dispatch, "applies", lambda *tensors: False)
    yield calls


def test_bf16_grouped_gemm_forward_and_weight_gradient(grouped_gemm: Calls) -> None:
    rng = np.random.default_rng(0)
    counts = [5, 0, 3, 9]
    x = rounded(rng.standard_normal((sum(counts), 8)), "bfloat16")
    w = rounded(rng.standard_normal((4, 8, 6)), "bfloat16")
    dy = rounded(rng.standard_normal((sum(counts), 6)), "bfloat16")
    xt, wt = paddle.to_tensor(x).astype("bfloat16"), paddle.to_tensor(w).astype("bfloat16")
    xt.stop_gradient = wt.stop_gradient = False
    layout = plan_layout(counts, xt, "ragged")
    assert layout.groups is None  # the grouped GEMM's ragged layout
    y = layout.matmul(xt, wt)
    (y.astype("float32") * paddle.to_tensor(dy)).sum().backward()
    assert y.dtype == wt.grad.dtype == xt.grad.dtype == paddle.bfloat16
    assert list(wt.grad.shape) == [4, 8, 6]
    assert [c[:2] for c in grouped_gemm] == [(False, False), (False, True), (True, False)]
    assert {c[2] for c in grouped_gemm} == {"paddle.bfloat16"}  # computed in bf16
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    want_y = np.concatenate([x[starts[e] : starts[e + 1]] @ w[e] for e in range(4)])
    want_dw = np.stack([x[starts[e] : starts[e + 1]].T @ dy[starts[e] : starts[e + 1]]
                        for e in range(4)])  # fmt: skip
    bf16 = allclose_args("bfloat16")
    np.testing.assert_allclose(y.astype("float32").numpy(), want_y, err_msg="y", **bf16)
    np.testing.assert_allclose(wt.grad.astype("float32").numpy(), want_dw, err_msg="dw", **bf16)
    assert not wt.grad[1].astype("float32").numpy().any()  # no rows: exactly zero
    # negative control: the weight gradient of another expert order is rejected
    assert not close(wt.grad.astype("float32").numpy()[::-1], want_dw, "bfloat16")


@pytest.mark.gpu
def test_bf16_batched_gemm_on_gpu_with_weight_gradients() -> None:
    """The real kernel, bf16, forward + input and weight gradients, an expert without rows,
    against the CPU float32 groups path on the same bf16-rounded inputs."""
    rng = np.random.default_rng(1)
    counts = [7, 0, 12, 3]
    x = rounded(rng.standard_normal((sum(counts), 16)), "bfloat16")
    w = rounded(rng.standard_normal((4, 16, 24)), "bfloat16")
    dy = rounded(rng.standard_normal((sum(counts), 24)), "bfloat16")
    results = {}
    for place, dtype in (("cpu", "float32"), ("gpu", "bfloat16")):
        paddle.set_device(place)
        try:
            xt, wt = paddle.to_tensor(x).astype(dtype), paddle.to_tensor(w).astype(dtype)
            xt.stop_gradient = wt.stop_gradient = False
            layout = plan_layout(counts, xt, "ragged")
            assert (layout.groups is None) == (place == "gpu")
            y = layout.matmul(xt, wt)
            (y.astype("float32") * paddle.to_tensor(dy)).sum().backward()
            assert wt.grad.dtype == wt.dtype
            results[place] = [t.astype("float32").numpy() for t in (y, xt.grad, wt.grad)]
        finally:
            paddle.set_device("cpu")
    for name, got, want in zip(("y", "dx", "dw"), results["gpu"], results["cpu"], strict=True):
        np.testing.assert_allclose(got, want, err_msg=name, **allclose_args("bfloat16"))
    assert not results["gpu"][2][1].any()
    assert not close(results["gpu"][2][::-1], results["cpu"][2], "bfloat16")


# -- rows cast before dispatch -----------------------------------------------------------------


def _bf16_moe(seed: int = 3) -> MoE:
    args = preset(
        "tiny_glm_moe", hidden_size=H, num_heads=2, num_kv_heads=1, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
    )  # fmt: skip
    paddle.seed(seed)
    paddle.set_default_dtype("bfloat16")
    try:
        return MoE(args)
    finally:
        paddle.set_default_dtype("float32")


def _x(seed: int = 4) -> paddle.Tensor:
    x = paddle.to_tensor(np.random.default_rng(seed).standard_normal((2, 24, H)).astype("float32"))
    x.stop_gradient = False
    return x


def _grads(module: MoE, x: paddle.Tensor, forward: Any) -> dict[str, np.ndarray]:
    """Output and every gradient of ``Σ probe · forward(x)``."""
    for p in module.parameters():
        p.clear_gradient(set_to_zero=False)
    x.clear_gradient()
    probe = paddle.to_tensor(np.random.default_rng(9).standard_normal(x.shape).astype("float32"))
    out = forward(x)
    (out.reshape(probe.shape) * probe).sum().backward()
    res = {"out": out.numpy(), "x.grad": x.grad.numpy()}
    for name, p in module.named_parameters():
        if p.grad is not None:
            res[name] = p.grad.astype("float32").numpy()
    return res


def _float32_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer as before issue 21: rows in the activations' dtype, cast by the GEMM."""
    monkeypatch.setattr(GroupedExperts, "row_dtype", lambda self, x: x.dtype)


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    assert {"out", "x.grad", "gate.weight", "experts.gate_up_proj", "experts.down_proj"} <= a.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_moe_rows_cast_before_dispatch_change_nothing(
    grouped_gemm: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer, x = _bf16_moe(), _x()
    sent: list[paddle.Tensor] = []
    real_permute = moe.permute

    def recording(*args: Any, **kwargs: Any) -> paddle.Tensor:
        sent.append(real_permute(*args, **kwargs))
        return sent[-1]

    monkeypatch.setattr(moe, "permute", recording)
    cast = _grads(layer, x, layer)
    with monkeypatch.context() as m:
        _float32_rows(m)
        plain = _grads(layer, x, layer)
    _same(cast, plain)
    assert [t.dtype for t in sent] == [paddle.bfloat16, paddle.float32]
    assert nbytes(sent[0]) * 2 == nbytes(sent[1])  # half the buffer
    # negative control: the naive cast (tokens cast before the permute) sums each token's k
    # row gradients in bf16: the input gradient differs
    monkeypatch.setattr(moe, "permute", lambda flat, d, dtype=None: real_permute(
        flat.astype(dtype), d) if dtype is not None else real_permute(flat, d))  # fmt: skip
    naive = _grads(layer, x, layer)
    np.testing.assert_array_equal(naive["out"], plain["out"])
    assert not np.array_equal(naive["x.grad"], plain["x.grad"])


def test_expert_parallel_rows_travel_in_bf16_and_change_nothing(
    grouped_gemm: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ep path (`expert_parallel_rows`, over a one-rank group here): what goes into each
    all-to-all (dispatch, and the expert outputs back) is bf16 — half the bytes — and the
    outputs and gradients equal float32 rows' bitwise."""
    layer, x = _bf16_moe(5), _x(6)
    solo = Exchange(NamedGroup("ep", 0, -1, [0], pg=None))
    exchanged: list[paddle.Tensor] = []
    real = expert_parallel.exchange_rows

    def recording(rows: paddle.Tensor, *args: Any) -> paddle.Tensor:
        exchanged.append(rows)
        return real(rows, *args)

    monkeypatch.setattr(expert_parallel, "exchange_rows", recording)

    def forward(x: paddle.Tensor) -> paddle.Tensor:
        flat = x.reshape([-1, H])
        routing = layer.gate.route(flat)
        d = build_dispatch(routing.ids, layer.gate.num_experts)
        rows = permute(flat, d, layer.experts.row_dtype(flat))
        out, _ = expert_parallel.expert_parallel_rows(layer.experts, rows, d.counts, solo)
        return combine(out, d, routing.weights)

    cast = _grads(layer, x, forward)
    bf16_bytes = [nbytes(t) for t in exchanged]
    assert [t.dtype for t in exchanged] == [paddle.bfloat16] * 2  # rows out, outputs back
    exchanged.clear()
    with monkeypatch.context() as m:
        _float32_rows(m)
        plain = _grads(layer, x, forward)
    assert [t.dtype for t in exchanged] == [paddle.float32] * 2
    assert [2 * n for n in bf16_bytes] == [nbytes(t) for t in exchanged]
    _same(cast, plain)


def test_cpu_and_float32_experts_keep_the_activations_dtype() -> None:
    """Without the grouped GEMM (CPU groups), or with float32 weights, rows are not cast."""
    x = paddle.zeros([4, H])
    assert _bf16_moe().experts.row_dtype(x) == paddle.float32  # CPU: batched matmuls
    f32 = GroupedExperts(4, H, 8, std=0.02)
    assert f32.row_dtype(x) == paddle.float32
    with pytest.raises(ValueError, match="do not describe"):
        batched_gemm_matmul(x, f32.gate_up_proj, [1, 1, 1, 0])
    assert TOLERANCE["bfloat16"] > TOLERANCE["float32"]
