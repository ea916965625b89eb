"""GLM-4.5 MoE: routing (selection by score + bias, weights from raw sigmoid scores), k experts
per token, shared experts always on, first-k dense layers, numpy reference, determinism.

(The grouped expert compute against the old per-expert loop: `test_moe_dispatch.py`.)"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.models import build_model, preset
from flashcp.models.layers import SwiGLU
from flashcp.models.moe import MoE, TopkRouter

H, E, K = 8, 6, 2


def _args(**overrides):
    base = dict(
        hidden_size=H,
        num_heads=2,
        num_kv_heads=1,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=4,
        num_shared_experts=1,
        first_k_dense_replace=0,
    )
    return preset("tiny_glm_moe", **{**base, **overrides})


def _tokens(n: int = 20, seed: int = 0) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal((n, H)).astype("float32"))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _set(t: paddle.Tensor, value: np.ndarray) -> None:
    paddle.assign(paddle.to_tensor(value.astype("float32")), output=t)


def test_bias_selects_but_raw_scores_weight() -> None:
    paddle.seed(0)
    router = TopkRouter(_args(routed_scaling_factor=2.5))
    x = _tokens()
    scores = _sigmoid(x.numpy() @ router.weight.numpy())
    # A large bias on experts 4 and 5 must make them the choice regardless of their scores.
    _set(router.e_score_correction_bias, np.array([0, 0, 0, 0, 10.0, 10.0]))
    ids, weights = router(x)
    assert (np.sort(ids.numpy(), axis=-1) == [4, 5]).all()
    raw = scores[:, 4:6]
    want = raw / raw.sum(-1, keepdims=True) * 2.5
    order = np.argsort(ids.numpy(), axis=-1)
    np.testing.assert_allclose(np.take_along_axis(weights.numpy(), order, -1), want, rtol=1e-5)


def test_without_bias_topk_of_scores_and_unnormalised_weights() -> None:
    paddle.seed(1)
    router = TopkRouter(_args(norm_topk_prob=False, routed_scaling_factor=1.5))
    x = _tokens()
    scores = _sigmoid(x.numpy() @ router.weight.numpy())
    ids, weights = router(x)
    want_ids = np.sort(np.argsort(-scores, axis=-1)[:, :K], axis=-1)
    np.testing.assert_array_equal(np.sort(ids.numpy(), -1), want_ids)
    want_w = np.take_along_axis(scores, ids.numpy(), -1) * 1.5
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-5)


def test_bias_is_a_buffer_and_gets_no_gradient() -> None:
    paddle.seed(0)
    moe = MoE(_args())
    names = [n for n, _ in moe.named_parameters()]
    assert "gate.weight" in names and "gate.e_score_correction_bias" not in names
    assert "gate.e_score_correction_bias" in moe.state_dict()
    moe(_tokens().unsqueeze(0)).sum().backward()
    assert moe.gate.weight.grad is not None  # through the routing weights


def _swiglu_np(layer: SwiGLU, x: np.ndarray) -> np.ndarray:
    g = x @ layer.gate_proj.weight.numpy()
    u = x @ layer.up_proj.weight.numpy()
    return (g * _sigmoid(g) * u) @ layer.down_proj.weight.numpy()


def _expert_np(moe: MoE, e: int, x: np.ndarray) -> np.ndarray:
    """Routed expert `e` in numpy, from its slices of the stacked weights."""
    inter = moe.experts.intermediate_size
    gate_up = moe.experts.gate_up_proj.numpy()[e]
    g, u = x @ gate_up[:, :inter], x @ gate_up[:, inter:]
    return (g * _sigmoid(g) * u) @ moe.experts.down_proj.numpy()[e]


@pytest.mark.parametrize("shared", [0, 2])
def test_matches_numpy_reference_and_counts(shared: int) -> None:
    paddle.seed(2)
    moe = MoE(_args(num_shared_experts=shared))
    _set(moe.gate.e_score_correction_bias, np.linspace(-0.05, 0.05, E))
    x = _tokens(24, seed=3)
    got = moe(x.reshape([2, 12, H])).numpy().reshape(24, H)
    xn = x.numpy().astype(np.float64)  # the reference in float64
    scores = _sigmoid(xn @ moe.gate.weight.numpy())
    choice = scores + moe.gate.e_score_correction_bias.numpy()
    want = np.zeros_like(xn)
    biased = np.zeros_like(xn)  # negative control: weights from the biased choice scores
    hits = np.zeros(E, dtype=np.int64)
    for t in range(24):
        top = np.argsort(-choice[t])[:K]
        w = scores[t, top] / scores[t, top].sum()
        wrong = choice[t, top] / choice[t, top].sum()
        for e, wk, bk in zip(top, w, wrong, strict=True):
            out = _expert_np(moe, e, xn[t : t + 1])[0]
            want[t] += wk * out
            biased[t] += bk * out
            hits[e] += 1
    if shared:
        assert moe.shared_experts is not None
        assert list(moe.shared_experts.gate_proj.weight.shape) == [H, 4 * shared]
        want += _swiglu_np(moe.shared_experts, xn)
    else:
        assert moe.shared_experts is None
    # float32 model vs float64 reference: the float32 rule (bench.numerics), n = H (the
    # hidden reductions of the router and gate/up; the down projection's is shorter)
    numerics.assert_close(got, want, n=H, what="moe output")
    if shared:
        biased += _swiglu_np(moe.shared_experts, xn)
    numerics.assert_rejects(biased, want, n=H)
    np.testing.assert_array_equal(moe.last_tokens_per_expert, hits)
    assert moe.last_tokens_per_expert.sum() == 24 * K  # every token reaches exactly k experts


def test_each_token_gets_k_distinct_experts() -> None:
    paddle.seed(0)
    router = TopkRouter(_args(num_experts_per_tok=3))
    ids, _ = router(_tokens(50))
    ids = ids.numpy()
    assert ids.shape == (50, 3)
    assert all(len(set(row)) == 3 for row in ids)


def test_shared_expert_always_applied() -> None:
    paddle.seed(0)
    moe = MoE(_args())
    _set(moe.experts.down_proj, np.zeros(moe.experts.down_proj.shape))
    x = _tokens()
    want = _swiglu_np(moe.shared_experts, x.numpy().astype(np.float64))  # float64 reference
    numerics.assert_close(moe(x).numpy(), want, n=H, what="shared expert")  # float32 rule


def test_unrouted_experts_get_zero_gradient() -> None:
    paddle.seed(0)
    moe = MoE(_args())
    _set(moe.gate.e_score_correction_bias, np.array([10.0, 10.0, 0, 0, 0, 0]))
    moe(_tokens()).sum().backward()
    assert list(moe.last_tokens_per_expert) == [20, 20, 0, 0, 0, 0]
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(moe.experts, name).grad.numpy()
        assert all(np.abs(grad[e]).max() > 0 for e in (0, 1))
        np.testing.assert_array_equal(grad[2:], np.zeros_like(grad[2:]))


@pytest.mark.parametrize(("first_k", "dense"), [(0, []), (1, [0]), (2, [0, 1])])
def test_first_k_layers_are_dense(first_k: int, dense: list[int]) -> None:
    paddle.seed(0)
    model = build_model(preset("tiny_glm_moe", first_k_dense_replace=first_k))
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, MoE) == (i not in dense)
        if i in dense:
            assert list(layer.mlp.gate_proj.weight.shape) == [64, 128]  # intermediate_size


def test_deterministic() -> None:
    paddle.seed(0)
    moe = MoE(_args())
    x = _tokens(64)
    a, b = moe(x).numpy(), moe(x).numpy()
    np.testing.assert_array_equal(a, b)


def test_router_affinities_computed_with_autocast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 autocast (GPU O1) would cast the router's float32 matmul to bf16: the affinities
    must be computed inside an autocast-disabled region. (CPU Paddle never autocasts, so the
    test records the region the matmul runs in; the gpu tier checks the dtype for real.)"""
    state: list[bool] = []
    real_auto_cast, real_matmul = paddle.amp.auto_cast, paddle.matmul
    depth = [0]

    class Recorder:
        def __init__(self, enable: bool = True, **kwargs: object) -> None:
            self.enable, self.inner = enable, real_auto_cast(enable=enable, **kwargs)

        def __enter__(self) -> None:
            depth[0] += 0 if self.enable else 1
            self.inner.__enter__()

        def __exit__(self, *exc: object) -> None:
            depth[0] -= 0 if self.enable else 1
            self.inner.__exit__(*exc)

    def matmul(*args: object, **kwargs: object) -> paddle.Tensor:
        state.append(depth[0] > 0)
        return real_matmul(*args, **kwargs)

    monkeypatch.setattr(paddle.amp, "auto_cast", Recorder)
    monkeypatch.setattr(paddle, "matmul", matmul)
    router = TopkRouter(preset("tiny_glm_moe"))
    routing = router.route(paddle.randn([6, router.weight.shape[0]]))
    assert state == [True] and routing.scores.dtype == paddle.float32


@pytest.mark.gpu
def test_router_affinities_float32_under_bf16_autocast_on_gpu() -> None:
    paddle.set_device("gpu")
    router = TopkRouter(preset("tiny_glm_moe"))
    x = paddle.randn([64, router.weight.shape[0]])
    want = router.route(x).scores
    with paddle.amp.auto_cast(enable=True, dtype="bfloat16", level="O1"):
        got = router.route(x).scores
    assert got.dtype == paddle.float32
    np.testing.assert_array_equal(got.numpy(), want.numpy())
