"""Grouped expert compute (`flashcp.models.moe_dispatch`, `experts`, `grouped_matmul`) against the
old per-expert loop (`scripts/bench/moe_loop.py`): same outputs and gradients (every layout, a
skewed router), bitwise deterministic, bf16 storage upcast chunk by chunk, the
capacity factor's drops (outputs, and the routing, router and input gradients against a
float64 reference: `moe_reference.routed_reference`; the permutation's backward against
autograd's own gather), and the dispatch pieces on their own."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bench import numerics
from bench.moe_loop import LoopMoE
from flashcp.distributed import Exchange
from flashcp.distributed.groups import NamedGroup
from flashcp.metrics import memory
from flashcp.models import grouped_matmul as gm
from flashcp.models import preset
from flashcp.models.expert_layout import capacity_for, layout_groups
from flashcp.models.expert_parallel import expert_parallel_rows
from flashcp.models.experts import LAYOUTS, plan_layout
from flashcp.models.moe import MoE, Routing
from flashcp.models.moe_dispatch import build_dispatch, combine, permute, relayout
from helpers.moe_reference import permute_reference, routed_reference

H = 32
RTOL = 1e-6
"""Outputs and gradients equal the loop's to this, norm-wise relative (issue 12)."""


def _args(**kw):
    base = dict(
        hidden_size=H,
        num_heads=2,
        num_kv_heads=1,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=8,
        num_shared_experts=1,
    )
    return preset("tiny_glm_moe", **{**base, **kw})


def _x(rows: int = 2, length: int = 24, seed: int = 0, shift: float = 0.0) -> paddle.Tensor:
    x = np.random.default_rng(seed).standard_normal((rows, length, H)).astype("float32") + shift
    t = paddle.to_tensor(x)
    t.stop_gradient = False
    return t


def _run(module, x: paddle.Tensor, probe: paddle.Tensor) -> dict[str, np.ndarray]:
    """Output, input gradient and every parameter gradient of `sum(module(x) * probe)`."""
    for p in module.parameters():
        p.clear_gradient()
    x.clear_gradient()
    out = module(x)
    (out * probe).sum().backward()
    res = {"out": out.numpy(), "x.grad": x.grad.numpy()}
    for name, p in module.named_parameters():
        if p.grad is not None and not name.startswith("experts."):
            res[name] = p.grad.astype("float32").numpy()  # (bf16 .numpy() gives raw bits)
    if isinstance(module, LoopMoE):
        res.update({f"experts.{k}": v for k, v in module.stacked_grads().items()})
    else:
        for name in ("gate_up_proj", "down_proj"):
            res[f"experts.{name}"] = getattr(module.experts, name).grad.astype("float32").numpy()
    return res


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


SHIFT = 0.5
"""Inputs of the skewed tests share this offset along every dimension, ..."""


def _skew(moe: MoE) -> None:
    """... which this router turns into large logits for experts 0 and 1: most tokens go
    there (one padded group would pad every expert to their counts)."""
    with paddle.no_grad():
        w = moe.gate.weight
        w[:, :2] = w[:, :2] + 0.5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("skewed", [False, True])
def test_grouped_equals_the_per_expert_loop(layout: str, skewed: bool) -> None:
    paddle.seed(0)
    moe = MoE(_args())
    if skewed:
        _skew(moe)
    moe.experts.layout = layout
    x = _x(shift=SHIFT if skewed else 0.0)
    probe = paddle.to_tensor(np.random.default_rng(9).standard_normal(x.shape).astype("float32"))
    loop = LoopMoE(moe)
    want = _run(loop, x, probe)
    got = _run(moe, x, probe)
    assert got.keys() == want.keys()
    for key in want:
        assert _rel(got[key], want[key]) <= RTOL, (key, _rel(got[key], want[key]))
    np.testing.assert_array_equal(moe.last_tokens_per_expert, loop.last_tokens_per_expert)
    if skewed:
        load = moe.last_tokens_per_expert
        assert load[:2].min() > 3 * load.mean()
    # negative control: the same comparison catches a wrong expert-weight layout (two experts'
    # slices swapped, which the loop reference does not see)
    with paddle.no_grad():
        w = moe.experts.down_proj
        w.set_value(paddle.concat([w[1:2], w[0:1], w[2:]], axis=0))
    wrong = _run(moe, x, probe)
    assert _rel(wrong["out"], want["out"]) > 1000 * RTOL


def test_grouped_is_bitwise_deterministic() -> None:
    paddle.seed(1)
    moe = MoE(_args())
    _skew(moe)
    x = _x(seed=3, shift=SHIFT)
    probe = paddle.ones(x.shape)
    a, b = _run(moe, x, probe), _run(moe, x, probe)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_layouts_from_counts() -> None:
    x = paddle.zeros([1, 4])
    bf16 = paddle.bfloat16  # weights stored narrower than the rows: cast, batched matmuls
    even = plan_layout([5, 6, 4, 5], x, "auto", bf16)
    assert len(even.groups) == 1 and even.rows == 4 * 6  # one padded bmm
    skewed = [200, 3, 2, 0, 4, 1, 0, 2]
    layout = plan_layout(skewed, x, "auto", bf16)
    assert layout.rows < 2 * sum(skewed) and len(layout.groups) > 1
    assert layout == plan_layout(skewed, x, "grouped")
    assert 3 not in {e for g in layout.groups for e in g.experts}  # no rows, no compute
    ragged = plan_layout(skewed, x, "ragged")
    assert ragged.rows == sum(skewed) and all(len(g.experts) == 1 for g in ragged.groups)
    # weights in the rows' dtype (given or default): one matmul per expert, so no padding —
    # the ragged buffer itself, which needs no relayout
    for same in (plan_layout(skewed, x, "auto"), plan_layout(skewed, x, "auto", x.dtype)):
        assert same == ragged and same.row_index() is None and same.is_ragged_order()
    assert plan_layout([2, 1], x, "auto").row_index() is None
    assert not layout.is_ragged_order() and layout.row_index() is not None
    assert plan_layout(skewed, x, "padded").rows == 6 * 200  # experts 3 and 6 left out
    with pytest.raises(ValueError, match="expert layout 'bogus'"):
        plan_layout(skewed, x, "bogus")
    # row_index places each expert's rows at the head of its padded slot
    index = plan_layout([2, 1], x, "padded").row_index().numpy()
    np.testing.assert_array_equal(index, [0, 1, 2])


def test_dispatch_sorts_entries_by_expert_in_token_order() -> None:
    ids = paddle.to_tensor([[2, 0], [0, 1], [2, 1]], dtype="int64")
    d = build_dispatch(ids, 3)
    assert d.counts == [2, 2, 2] and d.routed.tolist() == [2, 2, 2] and d.dropped == 0
    # buffer rows: expert 0 (tokens 0, 1), expert 1 (tokens 1, 2), expert 2 (tokens 0, 2)
    np.testing.assert_array_equal((d.entry // 2).numpy(), [0, 1, 1, 2, 0, 2])
    np.testing.assert_array_equal(d.slot.numpy(), [4, 0, 1, 2, 5, 3])
    x = paddle.to_tensor(np.arange(6, dtype="float32").reshape(3, 2))
    np.testing.assert_array_equal(permute(x, d).numpy()[:, 0], [0, 2, 2, 4, 0, 4])
    w = paddle.to_tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]])
    y = paddle.to_tensor(np.arange(6, dtype="float32").reshape(6, 1) + 1)
    # token 0: 0.5·row4 + 0.25·row0 ; token 1: 1·row1 + 2·row2 ; token 2: 3·row5 + 4·row3
    np.testing.assert_allclose(combine(y, d, w).numpy()[:, 0], [2.75, 8.0, 34.0])
    with pytest.raises(ValueError, match="permute: 2 tokens"):
        permute(x[:2], d)
    with pytest.raises(ValueError, match="combine: 5 expert rows"):
        combine(y[:5], d, w)


def test_relayout_pads_with_zero_rows_that_reach_no_token() -> None:
    ids = paddle.to_tensor([[1, 0], [1, 2]], dtype="int64")
    d = build_dispatch(ids, 3)
    layout = plan_layout(d.counts, paddle.zeros([1]), "padded")  # 3 experts × 2 rows
    laid = relayout(d, layout.row_index(), layout.rows)
    assert laid.rows == 6 and laid.padded
    x = paddle.to_tensor([[1.0, 2.0], [3.0, 4.0]])
    x.stop_gradient = False
    buf = permute(x, laid)
    np.testing.assert_array_equal(buf.numpy(), [[1, 2], [0, 0], [1, 2], [3, 4], [3, 4], [0, 0]])
    y = buf * 2.0
    w = paddle.to_tensor([[1.0, 10.0], [100.0, 1000.0]])
    w.stop_gradient = False
    out = combine(y, laid, w)
    np.testing.assert_allclose(out.numpy(), [[22, 44], [6600, 8800]])
    out.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[22, 22], [2200, 2200]])
    np.testing.assert_allclose(w.grad.numpy(), [[6, 6], [14, 14]])


def _capacity_reference(moe: MoE, x: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Routed sum with each expert keeping its first `capacity` entries in token order."""
    flat = paddle.to_tensor(x.reshape(-1, H))
    ids, weights = (t.numpy() for t in moe.gate(flat))
    inter = moe.experts.intermediate_size
    gu, down = moe.experts.gate_up_proj.numpy(), moe.experts.down_proj.numpy()
    out = np.zeros_like(x.reshape(-1, H))
    taken = np.zeros(moe.experts.num_experts, dtype=int)
    dropped = 0
    for t in range(flat.shape[0]):
        for j, e in enumerate(ids[t]):
            if taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            h = x.reshape(-1, H)[t] @ gu[e]
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            out[t] += weights[t, j] * (act @ down[e])
    return out, dropped


def test_capacity_drops_the_later_tokens_and_counts_them() -> None:
    paddle.seed(2)
    moe = MoE(_args(moe_capacity_factor=0.75, num_shared_experts=0))
    _skew(moe)
    x = _x(rows=1, length=32, seed=5, shift=SHIFT)
    capacity = capacity_for(0.75, 32, 4, 16)
    assert capacity == 6
    out = moe(x)
    want, dropped = _capacity_reference(moe, x.numpy(), capacity)
    assert dropped > 0
    assert _rel(out.numpy().reshape(-1, H), want) <= RTOL
    stats = moe.take_stats()
    assert stats.dropped == dropped and stats.load.sum() == 32 * 4
    out.sum().backward()  # dropped entries take no gradient; the kept ones do
    assert np.abs(moe.gate.weight.grad.numpy()).max() > 0
    assert moe.take_stats().dropped == 0  # reset
    assert capacity_for(0.0, 32, 4, 16) is None


def _routed_gradients(
    moe: MoE, x: paddle.Tensor, probe: paddle.Tensor, path: str
) -> tuple[np.ndarray, ...]:
    """(output `[T, H]`, expert ids `[T, k]`, routing-weight gradient `[T, k]`, router-weight
    gradient, input gradient `[T, H]`) of ``Σ probe · moe(x)``: `grouped` is the layer's own
    forward; `expert_parallel` the EP path (`expert_parallel_rows`) over a one-rank group,
    from the layer's pieces."""
    seen: list[Routing] = []
    grads: list[np.ndarray] = []
    route = moe.gate.route

    def recorded(flat: paddle.Tensor) -> Routing:
        routing = route(flat)
        routing.weights.register_hook(lambda g: grads.append(g.numpy()))
        seen.append(routing)
        return routing

    moe.gate.clear_gradients()
    x.clear_gradient()
    if path == "grouped":
        moe.gate.route = recorded  # the layer's forward, routing weights observed
        try:
            out = moe(x)
        finally:
            del moe.gate.route
    else:
        flat = x.reshape([-1, H])
        routing = recorded(flat)
        experts, top_k = moe.gate.num_experts, moe.gate.top_k
        capacity = capacity_for(moe.capacity_factor, int(flat.shape[0]), top_k, experts)
        d = build_dispatch(routing.ids, experts, capacity)
        solo = Exchange(NamedGroup("ep", 0, -1, [0], pg=None))
        rows, _ = expert_parallel_rows(moe.experts, permute(flat, d), d.counts, solo)
        out = combine(rows, d, routing.weights)
    (out.reshape(probe.shape) * probe).sum().backward()
    assert len(seen) == 1 and len(grads) == 1
    return (
        out.numpy().reshape(-1, H),
        seen[0].ids.numpy(),
        grads[0],
        moe.gate.weight.grad.numpy(),
        x.grad.numpy().reshape(-1, H),
    )


@pytest.mark.parametrize("path", ["grouped", "expert_parallel"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_capacity_drops_get_no_routing_gradient_and_the_router_gradient_is_right(
    path: str, norm_topk_prob: bool
) -> None:
    """With entries dropped by the capacity: the routing weight of every dropped entry gets a
    gradient of exactly 0 (it contributed nothing), and the routing-weight, router-weight and
    input gradients equal a float64 reference written from the definition (`routed_reference`),
    not the combine compared with itself: a dropped entry sends no gradient back through the
    permutation to its token."""
    paddle.seed(2)
    moe = MoE(
        _args(
            moe_capacity_factor=0.75,
            num_shared_experts=0,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=2.5,
        )
    )
    _skew(moe)
    x = _x(rows=1, length=32, seed=5, shift=SHIFT)
    probe = paddle.to_tensor(np.random.default_rng(7).standard_normal(x.shape).astype("float32"))
    capacity = capacity_for(0.75, 32, 4, 16)
    out, ids, weight_grad, router_grad, x_grad = _routed_gradients(moe, x, probe, path)
    ref = routed_reference(moe, x.numpy().reshape(-1, H), probe.numpy().reshape(-1, H), capacity)
    assert ref.margin > 1e-4  # no near tie: the float32 choice is the float64 one
    chosen = np.zeros_like(ref.chosen)
    np.put_along_axis(chosen, ids, True, axis=-1)
    np.testing.assert_array_equal(chosen, ref.chosen)
    numerics.assert_close(out, ref.out, n=H, norm="l2", what="routed output")
    dense = np.zeros(ref.weight_grad.shape)  # [T, k] in the router's order → [T, E]
    np.put_along_axis(dense, ids, weight_grad, axis=-1)
    dropped = ref.chosen & ~ref.keep
    assert dropped.sum() >= 10  # capacity 6 of a skewed router: many drops
    np.testing.assert_array_equal(
        dense[dropped], 0.0, err_msg="dropped entries must get no routing-weight gradient"
    )
    assert np.abs(dense[ref.keep]).min() > 0  # and the kept ones do
    numerics.assert_close(dense, ref.weight_grad, n=H, norm="l2", what="routing-weight grad")
    numerics.assert_close(router_grad, ref.router_grad, n=32, norm="l2", what="router grad")
    numerics.assert_close(x_grad, ref.x_grad, n=H, norm="l2", what="input grad")
    # negative control: the router gradient of the same tokens without drops is far away
    dropless = routed_reference(moe, x.numpy().reshape(-1, H), probe.numpy().reshape(-1, H), None)
    numerics.assert_rejects(router_grad, dropless.router_grad, n=32, norm="l2")


def test_permute_backward_gives_a_dropped_entry_no_gradient() -> None:
    """Capacity 2, three experts, top-2: experts 0 and 1 take tokens 0 and 1 first, so token 3
    is dropped by both and token 2 by expert 0 (kept by expert 2). The buffer, and the tokens'
    gradient for buffer-row gradients [1, 2], [3, 4], ..., equal a plain Paddle gather of the
    kept tokens (`permute_reference`: autograd's own backward): the fully dropped token gets
    exactly zero, the partly dropped one only its kept row's."""
    ids = np.array([[0, 1], [1, 0], [0, 2], [0, 1]])
    d = build_dispatch(paddle.to_tensor(ids), 3, capacity=2)
    assert d.counts == [2, 2, 1] and d.dropped == 3
    x0 = np.arange(8, dtype=np.float32).reshape(4, 2) + 1
    got, want = (paddle.to_tensor(x0, stop_gradient=False) for _ in range(2))
    rows = permute(got, d)
    ref = permute_reference(want, ids, 3, capacity=2)
    np.testing.assert_array_equal(rows.numpy(), ref.numpy())
    grad = paddle.to_tensor(np.arange(10, dtype=np.float32).reshape(5, 2) + 1)
    (rows * grad).sum().backward()
    (ref * grad).sum().backward()
    np.testing.assert_array_equal(got.grad.numpy(), want.grad.numpy())
    np.testing.assert_array_equal(got.grad.numpy()[3], [0, 0])
    np.testing.assert_array_equal(got.grad.numpy()[2], grad.numpy()[4])  # expert 2's row


def test_bf16_storage_upcasts_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-stored experts compute the float32 math on the rounded weights (to 1e-6), and
    never hold a float32 copy of all experts (the allocator's peak, against one chunk)."""
    args = _args(num_experts=64, hidden_size=H, moe_intermediate_size=256, num_shared_experts=0)
    paddle.seed(4)
    f32 = MoE(args)
    with paddle.no_grad():
        for p in f32.parameters():
            p.set_value(p.astype("bfloat16").astype("float32"))
    paddle.set_default_dtype("bfloat16")
    try:
        b16 = MoE(args)
    finally:
        paddle.set_default_dtype("float32")
    with paddle.no_grad():
        for p, q in zip(b16.parameters(), f32.parameters(), strict=True):
            p.set_value(q.astype(p.dtype))
    assert b16.experts.gate_up_proj.dtype == paddle.bfloat16
    x = _x(rows=1, length=4, seed=6)
    probe = paddle.ones(x.shape)
    want = _run(f32, x, probe)
    got = _run(b16, x, probe)
    for key in want:
        tol = RTOL if key in ("out", "x.grad") else 2.0**-8  # bf16 gradients: one rounding
        assert _rel(got[key], want[key]) <= tol, (key, _rel(got[key], want[key]))
    # memory: one padded group of all 64 experts (every one gets rows from 64 tokens)
    b16.experts.layout = "padded"
    x = _x(rows=1, length=64, seed=7)
    full_f32 = 4 * int(np.prod(b16.experts.gate_up_proj.shape))  # bytes of a float32 copy
    monkeypatch.setattr(gm, "CAST_CHUNK_BYTES", full_f32 // 16)
    chunked = _peak(b16, x)
    # negative control: one chunk holding every expert does show the full float32 copy
    monkeypatch.setattr(gm, "CAST_CHUNK_BYTES", 2 * full_f32)
    whole = _peak(b16, x)
    # the chunked peak is at least one float32 copy of the experts below the unchunked one
    assert chunked + 0.9 * full_f32 < whole, (chunked, whole, full_f32)


def _peak(moe: MoE, x: paddle.Tensor) -> int:
    """Allocator peak above the start of one forward + backward (existing gradients freed
    first; the new bf16 gradients, 3/4 of a float32 copy of `gate_up_proj`, included)."""
    for p in moe.parameters():
        p.clear_gradient(set_to_zero=False)
    memory.reset_peak()
    base = memory.allocated_bytes()
    moe(x).sum().backward()
    return memory.peak_bytes() - base


def test_grouped_matmul_checks_its_rows() -> None:
    w = paddle.zeros([2, 3, 4])
    with pytest.raises(ValueError, match="groups cover 4 rows, x has 5"):
        gm.grouped_matmul(paddle.zeros([5, 3]), w, [gm.Group((0, 1), 2, 0)])
    with pytest.raises(ValueError, match=r"counts \[1, 1\] do not describe 3 rows"):
        gm.batched_gemm_matmul(paddle.zeros([3, 3]), w, [1, 1])


def test_per_expert_products_are_written_in_place_and_a_rowless_expert_gets_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU float32 path (one group per expert): every product lands in its own rows or its
    expert's block of one output, and an expert without rows gets an exact zero weight
    gradient even when the outputs' uninitialised memory holds NaNs."""
    rng = np.random.default_rng(4)
    xs, ws, probe = (rng.standard_normal(s).astype("float32") for s in ([6, 4], [3, 4, 5], [6, 5]))
    x, w = paddle.to_tensor(xs), paddle.to_tensor(ws)
    x.stop_gradient = w.stop_gradient = False
    groups = layout_groups([4, 0, 2], range(3), 1)
    assert [g.experts for g in groups] == [(0,), (2,)]
    full = paddle.full  # uninitialised outputs as NaNs: only what is written is defined
    monkeypatch.setattr(paddle, "empty", lambda shape, dtype=None: full(shape, np.nan, dtype))
    y = gm.grouped_matmul(x, w, groups)
    (y * paddle.to_tensor(probe)).sum().backward()
    want_y = np.concatenate([xs[:4] @ ws[0], xs[4:] @ ws[2]])
    want_dx = np.concatenate([probe[:4] @ ws[0].T, probe[4:] @ ws[2].T])
    numerics.assert_close(y.numpy(), want_y, n=4, norm="l2", what="products")
    numerics.assert_close(x.grad.numpy(), want_dx, n=5, norm="l2", what="input grad")
    dw = w.grad.numpy()
    numerics.assert_close(dw[0], xs[:4].T @ probe[:4], n=4, norm="l2", what="expert 0")
    numerics.assert_close(dw[2], xs[4:].T @ probe[4:], n=2, norm="l2", what="expert 2")
    np.testing.assert_array_equal(dw[1], np.zeros((4, 5), np.float32))
    # negative control: a swapped expert block is rejected by the same comparison
    numerics.assert_rejects(dw[2], xs[:4].T @ probe[:4], n=4, norm="l2")


@pytest.mark.gpu
def test_batched_gemm_on_gpu_equals_the_grouped_cpu_path() -> None:
    """Paddle's GPU grouped GEMM (forward and the PyLayer's backward) against the CPU groups."""
    rng = np.random.default_rng(0)
    counts = [5, 0, 3, 9]
    x = rng.standard_normal((sum(counts), 8)).astype("float32")
    w = rng.standard_normal((4, 8, 6)).astype("float32")
    dy = rng.standard_normal((sum(counts), 6)).astype("float32")
    results = []
    for place in ("cpu", "gpu"):
        paddle.set_device(place)
        xt, wt = paddle.to_tensor(x), paddle.to_tensor(w)
        xt.stop_gradient = wt.stop_gradient = False
        layout = plan_layout(counts, xt, "ragged")
        y = layout.matmul(xt, wt)
        (y * paddle.to_tensor(dy)).sum().backward()
        results.append((y.numpy(), xt.grad.numpy(), wt.grad.numpy()))
    paddle.set_device("cpu")
    for a, b in zip(*results, strict=True):
        assert _rel(b, a) <= 1e-5


@pytest.mark.parametrize(("dtype", "n"), [("float32", 5), ("bfloat16", 4), ("bfloat16", 5)])
def test_weight_gradient_assembly_puts_each_expert_in_place(dtype: str, n: int) -> None:
    """Parts for experts (3, 0) and (1,), expert 2 absent: every path (in-place float32
    scatter, bf16 through an int32 view, the odd-width concat + gather) gives the same."""
    rng = np.random.default_rng(0)
    parts_np = {3: rng.standard_normal((2, n)), 0: rng.standard_normal((2, n)),
                1: rng.standard_normal((2, n))}  # fmt: skip
    w = paddle.zeros([4, 2, n], dtype=dtype)
    parts = []
    for experts in ((3, 0), (1,)):
        block = paddle.to_tensor(np.stack([parts_np[e] for e in experts]).astype("float32"))
        parts.append((experts, paddle.to_tensor(list(experts)), block.astype(dtype)))
    got = gm._assemble(w, parts).astype("float32").numpy()
    want = np.zeros((4, 2, n), np.float32)
    for e, v in parts_np.items():
        want[e] = paddle.to_tensor(v.astype("float32")).astype(dtype).astype("float32").numpy()
    np.testing.assert_array_equal(got, want)


def test_ragged_buffer_through_enter_and_leave_equals_the_relayout_path() -> None:
    """The route expert parallelism takes (rows arrive as an expert-ordered ragged buffer):
    `ExpertLayout.enter` / `leave` around the experts give what `relayout` gives, values and
    gradients."""
    paddle.seed(5)
    moe = MoE(_args(num_shared_experts=0))
    x = _x(rows=1, length=20, seed=8)
    flat = x.reshape([-1, H])
    probe = paddle.to_tensor(np.random.default_rng(2).standard_normal((20, H)).astype("float32"))
    routing = moe.gate.route(flat)
    d = build_dispatch(routing.ids, 16)
    moe.experts.layout = "grouped"  # padded groups (the cast path's layout), to move rows
    layout = moe.experts.plan(d.counts, flat)
    assert layout.rows > d.rows  # padded groups
    ragged = permute(flat, d)
    via_enter = combine(layout.leave(moe.experts(layout.enter(ragged), layout)), d, routing.weights)
    (via_enter * probe).sum().backward()
    g1 = [x.grad.numpy(), moe.experts.gate_up_proj.grad.numpy(), moe.gate.weight.grad.numpy()]
    for p in (x, moe.experts.gate_up_proj, moe.experts.down_proj, moe.gate.weight):
        p.clear_gradient()
    laid = relayout(d, layout.row_index(), layout.rows)
    flat = x.reshape([-1, H])  # a fresh graph for the second pass
    direct = combine(moe.experts(permute(flat, laid), layout), laid, moe.gate.route(flat).weights)
    (direct * probe).sum().backward()
    g2 = [x.grad.numpy(), moe.experts.gate_up_proj.grad.numpy(), moe.gate.weight.grad.numpy()]
    np.testing.assert_array_equal(via_enter.numpy(), direct.numpy())
    # gradients: the float32 rule (bench.numerics), norm-wise; the input's over the hidden
    # size, the weights' over the 20 tokens
    for what, a, b, n in zip(("x", "gate_up_proj", "gate"), g1, g2, (H, 20, 20), strict=True):
        numerics.assert_close(a, b, n=n, norm="l2", what=what)
    with pytest.raises(ValueError, match="3 row counts for 16 experts"):
        moe.experts.plan([1, 2, 3], flat)


@pytest.mark.parametrize("body", ["numpy", "paddle"])
@pytest.mark.parametrize(
    ("padded", "capacity", "frozen"),
    [(False, None, False), (True, None, False), (False, 20, False), (True, 20, True)],
    ids=["dropless", "padded", "capacity", "padded-capacity-frozen-weights"],
)
def test_permute_and_combine_bodies_match_a_float64_reference(
    monkeypatch: pytest.MonkeyPatch, body: str, padded: bool, capacity: int | None, frozen: bool
) -> None:
    """CPU float32 runs the permute's and the combine's numpy bodies, every other dtype or
    device their Paddle ones (`moe_dispatch.applies` False here): both give the buffer, the
    combined tokens and the gradients of tokens, rows and weights of the formulas in float64
    (padding rows zero, dropped entries nothing, frozen weights no gradient) under the
    numerics rule; the numpy sums are bitwise the float32 sum over j = 0..k-1 in order."""
    from flashcp.models import moe_dispatch

    tokens, experts, top_k = 40, 6, 3
    rng = np.random.default_rng(7)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    d = build_dispatch(paddle.to_tensor(ids), experts, capacity)
    assert (d.dropped > 0) == (capacity is not None)
    layout = plan_layout(d.counts, paddle.zeros([1]), "padded" if padded else "ragged")
    laid = relayout(d, layout.row_index(), layout.rows)
    assert laid.padded == padded
    calls: list[str] = []
    real_sums = moe_dispatch._entry_sums
    spy = lambda *a: calls.append("sum") or real_sums(*a)  # noqa: E731
    monkeypatch.setattr(moe_dispatch, "_entry_sums", spy)
    if body == "paddle":
        monkeypatch.setattr(moe_dispatch, "applies", lambda *tensors: False)

    x0 = rng.standard_normal((tokens, H)).astype(np.float32)
    y0 = rng.standard_normal((laid.rows, H)).astype(np.float32)
    w0 = rng.random((tokens, top_k)).astype(np.float32)
    probe_rows = rng.standard_normal((laid.rows, H)).astype(np.float32)
    probe = rng.standard_normal((tokens, H)).astype(np.float32)
    x, y, w = (paddle.to_tensor(a, stop_gradient=False) for a in (x0, y0, w0))
    w.stop_gradient = frozen
    buf = permute(x, laid)
    out = combine(y, laid, w)
    ((buf * paddle.to_tensor(probe_rows)).sum() + (out * paddle.to_tensor(probe)).sum()).backward()
    assert calls == (["sum"] * 2 if body == "numpy" else [])  # combine forward, permute backward

    entry, slot = laid.entry.numpy(), laid.slot.numpy().reshape(tokens, top_k)
    keep = np.ones((tokens, top_k)) if d.keep is None else d.keep.numpy().astype(np.float64)
    real = entry < tokens * top_k
    want_buf = np.zeros((laid.rows, H))
    want_buf[real] = x0[entry[real] // top_k]
    kw = keep * w0
    want_out = np.einsum("tj,tjh->th", kw, y0.astype(np.float64)[slot])
    want_dx = np.einsum("tj,tjh->th", keep, probe_rows.astype(np.float64)[slot])
    want_dy = np.zeros((laid.rows, H))
    want_dy[real] = kw.reshape(-1)[entry[real], None] * probe[entry[real] // top_k]
    want_dw = keep * np.einsum("tjh,th->tj", y0.astype(np.float64)[slot], probe)
    np.testing.assert_array_equal(buf.numpy(), want_buf)  # a gather: exact
    numerics.assert_close(out.numpy(), want_out, n=top_k, what="combined tokens")
    numerics.assert_close(x.grad.numpy(), want_dx, n=top_k, what="token gradient")
    numerics.assert_close(y.grad.numpy(), want_dy, n=1, what="row gradient")
    assert not y.grad.numpy()[~real].any()  # padding rows: exactly zero
    if frozen:
        assert w.grad is None
    else:
        numerics.assert_close(w.grad.numpy(), want_dw, n=H, norm="l2", what="weight gradient")
        assert not w.grad.numpy()[keep == 0].any()  # a dropped entry: exactly zero
    if body == "numpy":  # the fixed order: ((w₀·y₀ + w₁·y₁) + w₂·y₂), in float32
        kw32 = (w0 * keep).astype(np.float32)
        seq = kw32[:, 0, None] * y0[slot[:, 0]]
        for j in range(1, top_k):
            seq = seq + kw32[:, j, None] * y0[slot[:, j]]
        np.testing.assert_array_equal(out.numpy(), seq)
