"""`model.residual_dtype`: the dtype of the residual stream between layers (and stages).

* `float32` (the default) is today's model: no cast anywhere (the golden losses cover it).
* `bfloat16` rounds the stream at every layer boundary — the embedding output and each
  layer's output; each layer (and the final norm) computes on the float32 upcast — so in
  backward the gradient reaching a layer's input is rounded as well. It equals, bitwise, an
  independent reference: the float32 model run layer by layer with numpy round-to-nearest-even
  to bf16 between the layers (values forward, gradients backward); a reference that rounds
  only the values, or nothing, differs (negative controls).
* Its loss stays within a derived bound of the float32 loss: rounding x to bf16 moves it by at
  most u·|x| (u = 2⁻⁸, bf16's unit roundoff: 8 significant bits, round to nearest), so to
  first order |Δloss| ≤ u · Σ_boundaries Σ_i |∂loss/∂h_i| · |h_i|, the gradients and values
  taken from the float32 run. The bound is attained by a perturbation that moves every element
  by u·|h_i| against the gradient's sign; twice that is rejected (negative control).
* Pipeline stages built alone, chained, equal the whole model with the transfers in bf16.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle.autograd import PyLayer

from flashcp.config import load_config
from flashcp.models import build_model, preset
from flashcp.models.layers import rotary_tables
from flashcp.models.rope import model_inverse_frequencies
from flashcp.pipeline.stage import build_stage
from flashcp.problems import ProblemsError
from helpers.batches import packed_batch
from helpers.paths import CONFIGS

B, S = 2, 32
ARCHS = ("tiny", "tiny_glm", "tiny_glm_moe")
U_BF16 = 2.0**-8
"""bf16's unit roundoff: 8 significant bits, round to nearest: |round(x) − x| ≤ 2⁻⁸·|x|."""


def _grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _model(name: str, **overrides):
    paddle.seed(0)
    return build_model(preset(name, **overrides), seed=0)


def _train_step(name: str, **overrides) -> tuple[float, dict[str, np.ndarray]]:
    model = _model(name, **overrides)
    ids, pos, ctx = packed_batch()
    loss = F.cross_entropy(model.logits(model(ids, pos, ctx)), ids.unsqueeze(-1)).mean()
    loss.backward()
    return float(loss), _grads(model)


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 → the nearest bf16 value (ties to even), as float32: numpy bit arithmetic."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bias = ((bits >> 16) & 1) + 0x7FFF
    return (((bits + bias) >> 16) << 16).astype(np.uint32).view(np.float32)


class _Round(PyLayer):
    """Round the value (forward) and its gradient (backward) to bf16, in numpy."""

    @staticmethod
    def forward(ctx, x, grads: bool):  # type: ignore[override]
        ctx.grads = grads
        return paddle.to_tensor(round_bf16(x.numpy()))

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return paddle.to_tensor(round_bf16(g.numpy())) if ctx.grads else g


class _Shift(PyLayer):
    """Add a fixed perturbation (identity gradient)."""

    @staticmethod
    def forward(ctx, x, delta):  # type: ignore[override]
        return x + delta

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


def _reference(name: str, at_boundary, keep: list | None = None):
    """The float32 model run layer by layer with `at_boundary(h, index)` applied to the
    embedding output (index 0) and to each layer's output (1..N)."""
    model = _model(name)
    args = model.args
    ids, pos, ctx = packed_batch()
    h = at_boundary(model.model.embed(ids, pos), 0)
    if keep is not None:
        keep.append(h)
    rotary = None
    if not args.uses_learned_positions:
        rotary = rotary_tables(
            pos, model_inverse_frequencies(args), interleaved=args.interleaved_rotary
        )
    for i, layer in enumerate(model.model.layers):
        h = at_boundary(layer(h, rotary, ctx), i + 1)
        if keep is not None:
            keep.append(h)
    loss = F.cross_entropy(model.logits(model.model.norm(h)), ids.unsqueeze(-1)).mean()
    loss.backward()
    return float(loss), _grads(model)


def test_default_float32_has_no_casts() -> None:
    model = _model("tiny_glm")
    assert model.args.residual_dtype == "float32"
    assert model.activation_dtype == paddle.float32
    ids, pos, _ = packed_batch()
    assert model.model.embed(ids, pos).dtype == paddle.float32
    # the stream is the layers' own output: the same numbers as the explicit layer loop
    loss, grads = _train_step("tiny_glm")
    want_loss, want = _reference("tiny_glm", lambda h, i: h)
    assert loss == want_loss
    for key in want:
        np.testing.assert_array_equal(grads[key], want[key], err_msg=key)


@pytest.mark.parametrize("recompute", ("none", "full", "refined"))
@pytest.mark.parametrize("name", ARCHS)
def test_bfloat16_stream_equals_the_rounding_reference(name: str, recompute: str) -> None:
    loss, grads = _train_step(name, residual_dtype="bfloat16", recompute=recompute)
    want_loss, want = _reference(name, lambda h, i: _Round.apply(h, True))
    assert loss == want_loss
    assert grads.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(grads[key], want[key], err_msg=key)
    # negative controls: rounding only the values misses the gradient rounding; rounding
    # nothing misses both
    _, values_only = _reference(name, lambda h, i: _Round.apply(h, False))
    assert any(not np.array_equal(grads[k], values_only[k]) for k in want)
    plain_loss, _ = _reference(name, lambda h, i: h)
    assert loss != plain_loss


def test_bfloat16_model_state() -> None:
    model = _model("tiny_glm", residual_dtype="bfloat16")
    ids, pos, ctx = packed_batch()
    assert model.activation_dtype == paddle.bfloat16
    assert model.model.embed(ids, pos).dtype == paddle.bfloat16
    assert model(ids, pos, ctx).dtype == paddle.float32  # the final norm's output


@pytest.mark.parametrize("name", ARCHS)
def test_bfloat16_loss_within_the_first_order_bound(name: str) -> None:
    loss16, _ = _train_step(name, residual_dtype="bfloat16")
    kept: list[paddle.Tensor] = []

    def watch(h: paddle.Tensor, i: int) -> paddle.Tensor:
        h = _Shift.apply(h, paddle.zeros_like(h))  # a non-leaf node whose gradient we keep
        h.retain_grads()
        return h

    loss32, _ = _reference(name, watch, keep=kept)
    values = [h.numpy() for h in kept]
    grads = [h.grad.numpy() for h in kept]
    pairs = list(zip(grads, values, strict=True))
    bound = U_BF16 * sum(float(np.sum(np.abs(g) * np.abs(v))) for g, v in pairs)
    assert abs(loss16 - loss32) <= bound, (loss16, loss32, bound)
    # the bound is attained: moving every element by u·|h| against its gradient changes the
    # loss by about the bound (first order), twice that step exceeds it
    for scale, inside in ((1.0, True), (2.0, False)):
        shifts = [-scale * U_BF16 * np.abs(v) * np.sign(g) for g, v in pairs]

        def shift(h: paddle.Tensor, i: int, shifts: list = shifts) -> paddle.Tensor:
            return _Shift.apply(h, paddle.to_tensor(shifts[i]))

        moved, _ = _reference(name, shift)
        change = abs(moved - loss32)
        assert change > 0.5 * scale * bound, (scale, change, bound)
        assert (change <= 1.1 * bound) == inside, (scale, change, bound)


@pytest.mark.parametrize(("name", "pp"), [("tiny_glm", 2), ("tiny", 2), ("tiny_glm_moe", 2)])
def test_pipeline_stages_pass_bfloat16(name: str, pp: int) -> None:
    """Stages built alone and chained — the transfers in bf16 — give the whole model's
    forward and backward bitwise (the received input's gradient is the bf16 one backward
    sends)."""
    args = preset(name, residual_dtype="bfloat16", recompute="full")
    ids, pos, ctx = packed_batch()
    whole = build_model(args, seed=0)
    loss = F.cross_entropy(whole.logits(whole(ids, pos, ctx)), ids.unsqueeze(-1)).mean()
    loss.backward()
    want = _grads(whole)
    stages = [build_stage(args, s, pp, seed=0) for s in range(pp)]
    outputs, inputs = [], []
    h = ids
    for stage in stages:
        if not stage.is_first:
            h = paddle.to_tensor(h.numpy())  # what recv_tensor hands over: a fresh leaf
            assert h.dtype == stage.activation_dtype == paddle.bfloat16
            h.stop_gradient = False
            inputs.append(h)
        h = stage(h, pos, ctx)
        outputs.append(h)
    got_loss = F.cross_entropy(stages[-1].logits(h), ids.unsqueeze(-1)).mean()
    assert float(got_loss) == float(loss)
    got_loss.backward()
    for s in range(pp - 2, -1, -1):  # send each stage input's gradient to the stage before
        grad = inputs[s].grad
        assert grad.dtype == paddle.bfloat16
        paddle.autograd.backward([outputs[s]], [paddle.to_tensor(grad.numpy())])
    got: dict[str, np.ndarray] = {}
    for stage in stages:
        got.update(_grads(stage))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_unknown_residual_dtype_names_the_key() -> None:
    with pytest.raises(ValueError, match="model.residual_dtype"):
        preset("tiny_glm", residual_dtype="float16")


def test_config_key_is_checked_before_compute() -> None:
    config = CONFIGS / "glm" / "tiny_cp2.yaml"
    with pytest.raises(ProblemsError) as err:
        load_config(config, ["model.residual_dtype=float16"])
    assert [e.key for e in err.value.problems] == ["model.residual_dtype"]
    assert "bfloat16" in err.value.problems[0].message
    assert load_config(config).model.residual_dtype == "float32"
    assert load_config(config, ["model.residual_dtype=bfloat16"]).model.residual_dtype == (
        "bfloat16"
    )
