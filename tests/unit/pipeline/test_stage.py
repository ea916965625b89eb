"""The per-stage module (`flashcp.pipeline.stage`), on one process.

Stages built alone (`build_stage`: no full model anywhere) keep the full model's parameter
names, hold bitwise its initial values and only their share of them, and chaining their
forwards gives the full model's final hidden states and logits bitwise.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.models import StageSpec, build_model, estimate_parameters, preset
from flashcp.pipeline.stage import build_stage, split_layers, stage_spec


def _model(name: str, **overrides):
    return build_model(preset(name, **overrides), seed=0)


def _stage(name: str, s: int, pp: int, pp_layers=None, **overrides):
    return build_stage(preset(name, **overrides), s, pp, pp_layers, seed=0)


def _inputs(seq: int = 32):
    rng = np.random.default_rng(3)
    ids = paddle.to_tensor(rng.integers(0, 260, (2, seq)))
    pos = paddle.to_tensor(np.broadcast_to(np.arange(seq), (2, seq)).copy())
    mask = masks.causal_document_mask([[10, seq - 10], [7, 9, seq - 16]]).indices
    return ids, pos, AttentionContext(mask=mask, causal=True)


CASES = [
    ("tiny", {}, 2, None),
    ("tiny_glm", {}, 2, None),
    ("tiny", {"num_layers": 3, "position": "learned"}, 3, None),
    ("tiny_glm", {"num_layers": 4}, 3, [1, 2, 1]),
    ("tiny_glm_moe", {"num_layers": 3}, 2, [2, 1]),
    ("tiny", {"tie_embeddings": True}, 2, None),
    ("tiny_glm", {"num_layers": 3, "recompute": "full"}, 3, None),
]


@pytest.mark.parametrize(("name", "overrides", "pp", "pp_layers"), CASES)
def test_stages_built_alone_equal_the_full_model_bitwise(name, overrides, pp, pp_layers) -> None:
    """Every parameter of every stage built alone equals the one-process model's of the same
    name, and chaining the stages' forwards gives its hidden states and logits bitwise."""
    ids, pos, ctx = _inputs()
    full = _model(name, **overrides)
    weights = {n: p.numpy() for n, p in full.named_parameters()}
    want = full(ids, pos, ctx)
    stages = [_stage(name, s, pp, pp_layers, **overrides) for s in range(pp)]
    seen = set()
    for stage in stages:
        for n, p in stage.named_parameters():
            np.testing.assert_array_equal(p.numpy(), weights[n], err_msg=n)
            seen.add(n)
    assert seen == set(weights)
    h = ids
    for stage in stages:
        h = stage(h, pos, ctx)
        if not stage.is_last:
            assert list(h.shape) == stage.activation_shape(ids.shape)
            assert h.dtype == stage.activation_dtype
    np.testing.assert_array_equal(h.numpy(), want.numpy())  # final-norm hidden states
    np.testing.assert_array_equal(stages[-1].logits(h).numpy(), full.logits(want).numpy())
    # negative control: another seed gives other weights, so the equality above is not vacuous
    other = build_stage(preset(name, **overrides), 0, pp, pp_layers, seed=1)
    first = next(iter(other.named_parameters()))
    assert not np.array_equal(first[1].numpy(), weights[first[0]])


@pytest.mark.parametrize(("name", "overrides", "pp", "pp_layers"), CASES)
def test_each_stage_materialises_only_its_share(name, overrides, pp, pp_layers) -> None:
    """A stage holds exactly its layers' parameters (+ embeddings first, norm and head last):
    counted against the one-process model's parameters of those names and the formula."""
    args = preset(name, **overrides)
    full = {n: int(np.prod(p.shape)) for n, p in _model(name, **overrides).named_parameters()}
    ranges = split_layers(args.num_layers, pp, pp_layers)
    for s in range(pp):
        stage = _stage(name, s, pp, pp_layers, **overrides)
        r = ranges[s]

        def mine(n: str, s: int = s, r: range = r) -> bool:
            if n.startswith("model.layers."):
                return int(n.split(".")[2]) in r
            if n.startswith(("model.norm.", "lm_head.")):
                return s == pp - 1
            if n == "model.embed_tokens.weight":
                return s == 0 or (s == pp - 1 and args.tie_embeddings)
            return s == 0  # learned positions
        want = sum(v for n, v in full.items() if mine(n))
        got = sum(int(np.prod(p.shape)) for p in stage.parameters())
        assert got == want
        assert got == estimate_parameters(args, layers=r, first=s == 0, last=s == pp - 1)
        assert got < sum(full.values())


@pytest.mark.parametrize("tied", [False, True])
def test_stages_partition_the_parameters_by_name(tied: bool) -> None:
    full = _model("tiny_glm", num_layers=4, tie_embeddings=tied)
    names = {n for n, _ in full.named_parameters()}
    stages = [_stage("tiny_glm", s, 3, num_layers=4, tie_embeddings=tied) for s in range(3)]
    owned = [[n for n, _ in st.named_parameters()] for st in stages]
    assert set().union(*owned) == names
    shared = "model.embed_tokens.weight"
    assert shared in owned[0]
    assert (shared in owned[2]) is tied
    assert shared not in owned[1]
    assert sum(len(o) for o in owned) == len(names) + (1 if tied else 0)
    assert any(n.startswith("model.layers.3.") for n in owned[2])  # GLOBAL layer indices
    assert "model.norm.weight" in owned[2] and "model.norm.weight" not in owned[0]
    assert ("lm_head.weight" in owned[2]) is not tied
    # The tied matrix: each of the first and last stage holds its own copy, equal at build.
    assert stages[0].tied_weight is (stages[0].model.embed_tokens.weight if tied else None)
    assert stages[1].tied_weight is None
    assert (stages[2].tied_weight is not None) is tied
    if tied:
        assert stages[2].tied_weight is not stages[0].tied_weight
        np.testing.assert_array_equal(stages[2].tied_weight.numpy(), stages[0].tied_weight.numpy())
    assert full.tied_weight is None  # pp = 1: nothing to sync
    assert "stage=1/3, layers=[2, 3)" in repr(stages[1])
    assert [layer.index for layer in stages[2].decoder_layers()] == [3]
    with pytest.raises(IndexError, match="layer 0 is not on this stage"):
        stages[2].model.layers[0]


def test_stage_input_errors() -> None:
    ids, pos, ctx = _inputs()
    first, second = (_stage("tiny", s, 2) for s in range(2))
    with pytest.raises(ValueError, match="stage 1 takes hidden states"):
        second(ids, pos, ctx)
    with pytest.raises(ValueError, match="stage 0 of 2 takes token ids"):
        first(paddle.zeros([2, 32, 64]), pos, ctx)
    with pytest.raises(ValueError, match="positions \\[2, 16\\] must match"):
        first(ids, pos[:, :16], ctx)
    with pytest.raises(ValueError, match="positions \\[2, 16\\] must match"):
        second(paddle.zeros([2, 32, 64]), pos[:, :16], ctx)
    with pytest.raises(TypeError, match="must be an AttentionContext"):
        first(ids, pos, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be an AttentionContext"):
        second(paddle.zeros([2, 32, 64]), pos, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hidden_states needs the whole model"):
        first.hidden_states(ids, pos, ctx)
    learned = _stage("tiny", 0, 2, position="learned")
    with pytest.raises(ValueError, match="learned position embeddings only cover"):
        learned(ids, pos + 300, ctx)


def test_stage_construction_errors() -> None:
    args = preset("tiny")
    with pytest.raises(ValueError, match="stage 2 is outside 0..1"):
        build_model(args, stage=StageSpec(2, 2, range(0, 1)))
    with pytest.raises(ValueError, match="not a non-empty contiguous slice"):
        build_model(args, stage=StageSpec(0, 2, range(1, 1)))
    with pytest.raises(ValueError, match="not a non-empty contiguous slice"):
        build_model(args, stage=StageSpec(0, 2, range(0, 3)))
    with pytest.raises(ValueError, match="a single stage runs all 2 layers"):
        build_model(args, stage=StageSpec(0, 1, range(0, 1)))
    with pytest.raises(ValueError, match="sums to 3 but model.num_layers is 2"):
        build_stage(args, 0, 2, [2, 1])
    with pytest.raises(ValueError, match="stage 3 is outside 0..1"):
        stage_spec(args, 3, 2)
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        build_model(args, param_dtype="float16")
