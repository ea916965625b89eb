"""`bench.moe_step`: the step's GEMM list counts exactly the FLOPs the family's inventory and
`flashcp.metrics.flops` count (one source), the phase accounting adds up to the step, and the
page is rendered from its JSON alone."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from bench import moe_step
from flashcp.metrics.flops import causal_keys, flops_per_token
from flashcp.models import preset
from helpers.paths import ROOT


def _args_and_routing(name: str, tokens: int) -> tuple[object, list[list[int]]]:
    spec = dict(moe_step.SHAPES[name])
    args = preset(spec.pop("preset"), **spec)
    rng = np.random.default_rng(0)
    counts: list[list[int]] = []
    for _ in range(args.num_layers):
        if not args.num_experts:  # the dense shape: no routing
            counts.append([])
            continue
        picks = np.stack([rng.choice(args.num_experts, args.num_experts_per_tok, replace=False)
                          for _ in range(tokens)])  # fmt: skip
        counts.append(np.bincount(picks.ravel(), minlength=args.num_experts).tolist())
    return args, counts


@pytest.mark.parametrize("name", list(moe_step.SHAPES))
def test_the_gemms_are_the_model_flops(name: str) -> None:
    """Without the attention kernel's GEMMs: 3 × 2 × tokens × the weights a token multiplies
    (`matmul_weights`), exactly, at any top-k routing; with them, the model FLOPs of a causal
    document (`flops_per_token`) up to the floor's whole-column rounding of (T + 1) / 2 keys."""
    tokens = 256
    args, counts = _args_and_routing(name, tokens)
    gemms = moe_step.gemm_shapes(args, tokens, counts)
    weights = sum(g.flops for g in gemms if g.phase != "attention kernel")
    assert weights == 3 * 2 * tokens * args.matmul_weights()
    model = flops_per_token(args, tokens, keys=causal_keys(tokens)) * tokens
    total = sum(g.flops for g in gemms)
    assert total < model and total == pytest.approx(model, rel=1 / tokens)
    if args.num_experts:
        fewer = [c[:-1] + [0] for c in counts]  # control: an expert's rows lost
        lost = sum(g.flops for g in moe_step.gemm_shapes(args, tokens, fewer))
        assert lost < total
    else:  # control: the dense MLP's GEMMs are in the list (without them, not the FLOPs)
        without = [g for g in gemms if g.phase != "dense MLP"]
        assert {g.phase for g in gemms} >= {"dense MLP"}
        assert sum(g.flops for g in without) < total


def test_every_gemm_belongs_to_a_phase() -> None:
    args, counts = _args_and_routing("glm45_air / 8", 64)
    phases = {g.phase for g in moe_step.gemm_shapes(args, 64, counts)}
    assert phases <= set(moe_step.PHASES)
    assert "shared expert" in phases and "attention kernel" in phases


def test_the_accounting_adds_up_to_the_step() -> None:
    got = moe_step.account(
        4.0, {"expert GEMMs": {"forward": 1.0, "backward": 1.5}, "optimizer": {"update": 0.5}}
    )
    rows = got["phases"]
    assert rows["expert GEMMs"] == {"forward": 1.0, "backward": 1.5, "update": 0.0,
                                    "total": 2.5, "share": 0.625}  # fmt: skip
    assert rows["optimizer"]["total"] == 0.5 and rows["norms"]["total"] == 0.0
    assert rows["unattributed"]["total"] == 1.0
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert list(rows) == [*moe_step.PHASES, "unattributed"]
    with pytest.raises(ValueError, match="not in PHASES"):
        moe_step.account(1.0, {"typo": {"forward": 0.1}})


def test_the_floor_is_grouped_by_phase() -> None:
    gemms = [moe_step.Gemm("head and loss", 2, 3, 4), moe_step.Gemm("expert GEMMs", 1, 1, 1),
             moe_step.Gemm("expert GEMMs", 2, 1, 1, batch=3)]  # fmt: skip
    got = moe_step.floor_by_phase({"head and loss": 0.5, "expert GEMMs": 0.25}, gemms)
    assert got == {"head and loss": {"seconds": 0.5, "flops": 144},
                   "expert GEMMs": {"seconds": 0.25, "flops": 6 + 36}}  # fmt: skip


def test_the_page_is_its_json() -> None:
    rec = json.loads((ROOT / "docs" / "moe_step.json").read_text())
    assert (ROOT / "docs" / "moe_step.md").read_text() == moe_step.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["cases"][0]["step_over_floor"] += 1.0
    assert moe_step.PAGE.render(changed) != moe_step.PAGE.render(rec)
    for case in rec["cases"]:
        shares = [r["share"] for r in case["accounting"]["phases"].values()]
        assert sum(shares) == pytest.approx(1.0)


def test_the_padded_experts_variant_is_the_same_maths_and_is_undone() -> None:
    """`--compare padded_experts_concat_stack` times the experts as they were: padded groups,
    concatenated and stacked products — the same values under the numerics rule (a real
    before), a different buffer while it is on, and nothing of it left afterwards."""
    import paddle

    from bench import numerics
    from flashcp.models import experts, grouped_matmul
    from flashcp.models.moe import MoE

    args = preset("tiny_glm_moe", hidden_size=32, num_experts=8, moe_intermediate_size=16,
                  num_shared_experts=0)  # fmt: skip
    paddle.seed(0)
    moe = MoE(args)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((1, 64, 32)).astype("float32"))

    def run() -> tuple[np.ndarray, np.ndarray, int]:
        moe.clear_gradients()
        out = moe(x)
        (out * out).sum().backward()
        layout = moe.experts.plan(moe.last_tokens_per_expert.tolist(), x.reshape([-1, 32]))
        return out.numpy(), moe.experts.gate_up_proj.grad.numpy(), layout.rows

    saved = (grouped_matmul._ExpertMatmuls, experts.cpu_groups)
    out, grad, rows = run()
    with moe_step.VARIANTS["padded_experts_concat_stack"]():
        old_out, old_grad, old_rows = run()
    assert (grouped_matmul._ExpertMatmuls, experts.cpu_groups) == saved
    assert old_rows > rows == 64 * args.num_experts_per_tok  # padded then, ragged now
    numerics.assert_close(old_out, out, n=32, norm="l2", what="MoE output")
    numerics.assert_close(old_grad, grad, n=64, norm="l2", what="gate/up gradient")


def test_the_paddle_cross_entropy_variant_takes_paddles_path_and_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--compare paddle_cross_entropy` sends the head's own logits through Paddle's
    cross-entropy instead of the numpy log-softmax: the same log-probs under the numerics
    rule, the numpy layer not called while it is on, and the head as it was afterwards."""
    import paddle

    from bench import numerics
    from flashcp.models import cpu_elementwise, head

    calls: list[int] = []
    original_layer = cpu_elementwise.label_logprobs

    def counting(*args: object) -> object:
        calls.append(1)
        return original_layer(*args)

    monkeypatch.setattr(cpu_elementwise, "label_logprobs", counting)
    rng = np.random.default_rng(1)
    hidden = paddle.to_tensor(rng.standard_normal((1, 16, 8)).astype("float32"))
    weight = paddle.to_tensor(rng.standard_normal((8, 40)).astype("float32"))
    labels = paddle.to_tensor(rng.integers(0, 40, (1, 16)))

    def run() -> np.ndarray:
        return head.chunked_token_logprobs(lambda h: paddle.matmul(h, weight), hidden,
                                           labels).numpy()  # fmt: skip

    saved = head.token_logprobs
    numpy_lp = run()
    assert calls == [1]
    with moe_step.VARIANTS["paddle_cross_entropy"]():
        paddle_lp = run()
    assert calls == [1] and head.token_logprobs is saved
    numerics.assert_close(paddle_lp, numpy_lp, n=40, norm="l2", what="log-probs")


def test_the_paddle_permute_combine_variant_is_the_same_maths_and_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--compare paddle_permute_combine` runs the dispatch's Paddle bodies on CPU float32: no
    numpy sum while it is on (and again afterwards), the same MoE output and input gradient
    under the numerics rule."""
    import paddle

    from bench import numerics
    from flashcp.models import moe_dispatch
    from flashcp.models.moe import MoE

    args = preset("tiny_glm_moe", hidden_size=32, num_experts=8, moe_intermediate_size=16,
                  num_shared_experts=0)  # fmt: skip
    paddle.seed(0)
    moe = MoE(args)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((1, 64, 32)).astype("float32"))
    x.stop_gradient = False
    sums: list[int] = []
    real = moe_dispatch._entry_sums
    monkeypatch.setattr(moe_dispatch, "_entry_sums", lambda *a: sums.append(1) or real(*a))

    def run() -> tuple[np.ndarray, np.ndarray, int]:
        x.clear_gradient()
        sums.clear()
        out = moe(x)
        (out * out).sum().backward()
        return out.numpy(), x.grad.numpy(), len(sums)

    out, grad, numpy_sums = run()
    with moe_step.VARIANTS["paddle_permute_combine"]():
        old_out, old_grad, old_sums = run()
    assert numpy_sums == 2 and old_sums == 0  # combine forward and permute backward, or none
    assert run()[2] == 2  # undone
    numerics.assert_close(old_out, out, n=32, norm="l2", what="MoE output")
    numerics.assert_close(old_grad, grad, n=64, norm="l2", what="input gradient")


def test_the_zeroed_grads_variant_adds_into_zeros_and_changes_no_value() -> None:
    """`--compare zeroed_grads` gives every trained parameter a zero gradient before the step
    (Paddle's default `clear_grad`), so backward adds into it: the same gradients, bitwise
    (0 + g = g), where the released step writes fresh ones."""
    import paddle

    paddle.seed(0)
    layer = paddle.nn.Linear(8, 4)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((16, 8)).astype("float32"))

    def step() -> np.ndarray:
        (layer(x) ** 2).sum().backward()
        grad = layer.weight.grad.numpy().copy()
        layer.clear_gradients(set_to_zero=False)
        return grad

    released = step()
    assert layer.weight.grad is None
    with moe_step.VARIANTS["zeroed_grads"](layer):
        assert not np.any(layer.weight.grad.numpy()) and not np.any(layer.bias.grad.numpy())
        zeroed = step()
    np.testing.assert_array_equal(zeroed, released)
