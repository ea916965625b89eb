"""Pipeline stage split and the per-stage module, on one process.

`split_layers` validation messages name the config keys; `PipelineStage` slices keep the full
model's parameter names and partition its parameters; chaining the stages' forwards gives the
full model's final hidden states and logits bitwise.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.models import AttentionContext, build_model, preset
from flashcp.parallel import PipelineStage, split_layers

# -- split_layers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "pp"), [(n, pp) for pp in (1, 2, 3, 4) for n in range(pp, 13)]
)
def test_default_split_is_even_with_extras_first(num_layers: int, pp: int) -> None:
    ranges = split_layers(num_layers, pp)
    sizes = [len(r) for r in ranges]
    assert len(ranges) == pp
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # extras on the earliest stages
    assert all(r.step == 1 for r in ranges)


def test_default_split_examples() -> None:
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(3, 1) == [range(0, 3)]


def test_explicit_split() -> None:
    assert split_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    assert split_layers(6, 3, (1, 2, 3)) == [range(0, 1), range(1, 3), range(3, 6)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 2, [2, 1]), "parallel.pp_layers [2, 1] sums to 3 but model.num_layers is 4"),
        ((1, 2, None), "num_layers 1 < pp 2: each stage needs at least one layer"),
        ((3, 2, [1, 1, 1]), "parallel.pp_layers [1, 1, 1] has 3 entries but parallel.pp is 2"),
        ((4, 2, [4, 0]), "parallel.pp_layers [4, 0]: stage 1 has 0 layers"),
        ((4, 2, [2.0, 2]), "stage 0 has 2.0 layers; each stage needs an integer >= 1"),
        ((4, 2, [True, 3]), "stage 0 has True layers"),
        ((4, 0, None), "parallel.pp must be an integer >= 1, got 0"),
        ((0, 1, None), "model.num_layers must be an integer >= 1, got 0"),
    ],
)
def test_split_errors_name_the_config_key(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", "\\[").replace("]", "\\]")):
        split_layers(*args)


def test_too_few_layers_suggests_a_fix() -> None:
    with pytest.raises(ValueError, match="lower parallel.pp to at most 2"):
        split_layers(2, 3)


# -- PipelineStage ------------------------------------------------------------------------------


def _model(name: str, **overrides):
    paddle.seed(0)
    return build_model(preset(name, **overrides))


def _inputs(seq: int = 32):
    rng = np.random.default_rng(3)
    ids = paddle.to_tensor(rng.integers(0, 260, (2, seq)))
    pos = paddle.to_tensor(np.broadcast_to(np.arange(seq), (2, seq)).copy())
    mask = masks.causal_document_mask([[10, seq - 10], [7, 9, seq - 16]]).indices
    return ids, pos, AttentionContext(mask=mask, causal=True)


@pytest.mark.parametrize(
    ("name", "overrides", "pp", "pp_layers"),
    [
        ("tiny", {}, 2, None),
        ("tiny_glm", {}, 2, None),
        ("tiny", {"num_layers": 3, "position": "learned"}, 3, None),
        ("tiny_glm", {"num_layers": 4}, 3, [1, 2, 1]),
        ("tiny_glm_moe", {"num_layers": 3}, 2, [2, 1]),
        ("tiny", {"tie_embeddings": True}, 2, None),
        ("tiny_glm", {"num_layers": 3, "recompute": "full"}, 3, None),
    ],
)
def test_chained_stages_equal_full_model_bitwise(name, overrides, pp, pp_layers) -> None:
    ids, pos, ctx = _inputs()
    full = _model(name, **overrides)
    want = full(ids, pos, ctx)
    stages = [
        PipelineStage.from_model(_model(name, **overrides), s, pp, pp_layers) for s in range(pp)
    ]
    h = ids
    for stage in stages:
        h = stage(h, pos, ctx)
        if not stage.is_last:
            assert list(h.shape) == stage.activation_shape(ids.shape)
            assert h.dtype == stage.activation_dtype
    np.testing.assert_array_equal(h.numpy(), want.numpy())  # final-norm hidden states
    np.testing.assert_array_equal(stages[-1].logits(h).numpy(), full.logits(want).numpy())


@pytest.mark.parametrize("tied", [False, True])
def test_stages_partition_the_parameters_by_name(tied: bool) -> None:
    full = _model("tiny_glm", num_layers=4, tie_embeddings=tied)
    names = {n for n, _ in full.named_parameters()}
    stages = [PipelineStage.from_model(full, s, 3) for s in range(3)]
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
    # The tied matrix is named on the first and last stage only; it is the same Parameter here
    # because one model was sliced, in a real job each stage holds its own copy.
    assert stages[0].tied_weight is (stages[0].model.embed_tokens.weight if tied else None)
    assert stages[1].tied_weight is None
    assert (stages[2].tied_weight is not None) is tied
    assert PipelineStage.from_model(full, 0, 1).tied_weight is None  # pp = 1: nothing to sync
    assert "stage=1/3, layers=[2, 3)" in repr(stages[1])


def test_stage_input_errors() -> None:
    ids, pos, ctx = _inputs()
    first, second = (PipelineStage.from_model(_model("tiny"), s, 2) for s in range(2))
    with pytest.raises(ValueError, match="stage 1 takes hidden states"):
        second(ids, pos, ctx)
    with pytest.raises(ValueError, match="stage 0 takes token ids"):
        first(paddle.zeros([2, 32, 64]), pos, ctx)
    with pytest.raises(ValueError, match="positions \\[2, 16\\] must match"):
        first(ids, pos[:, :16], ctx)
    with pytest.raises(TypeError, match="must be an AttentionContext"):
        first(ids, pos, None)  # type: ignore[arg-type]
    learned = PipelineStage.from_model(_model("tiny", position="learned"), 0, 2)
    with pytest.raises(ValueError, match="learned position embeddings only cover"):
        learned(ids, pos + 300, ctx)


def test_stage_construction_errors() -> None:
    model = _model("tiny")
    with pytest.raises(ValueError, match="stage 2 is outside 0..1"):
        PipelineStage(model, 2, 2, range(0, 1))
    with pytest.raises(ValueError, match="not a non-empty contiguous slice"):
        PipelineStage(model, 0, 2, range(1, 1))
    with pytest.raises(ValueError, match="not a non-empty contiguous slice"):
        PipelineStage(model, 0, 2, range(0, 3))
    with pytest.raises(ValueError, match="sums to 3 but model.num_layers is 2"):
        PipelineStage.from_model(model, 0, 2, [2, 1])
