"""Models: shapes, GQA, tied embeddings, positions (rotary on GLOBAL positions, learned),
the rotary conventions against independent numpy versions of HF's, presets and problems()."""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp import masks
from flashcp.attention import registry as cp_modes
from flashcp.attention.context import AttentionContext
from flashcp.models import (
    ModelArgs,
    build_model,
    estimate_parameters,
    preset,
    token_logprobs,
)
from flashcp.models.decoder import Block
from flashcp.models.layers import apply_rotary, rotary_tables
from flashcp.models.moe import MoE
from flashcp.models.rope import inverse_frequencies

ARCH_PRESETS = ["tiny", "tiny_glm", "tiny_glm_moe"]
B, S = 2, 32


def _model(name: str, seed: int = 0, **overrides) -> paddle.nn.Layer:
    paddle.seed(seed)
    return build_model(preset(name, **overrides))


def _ids(batch: int = B, seq: int = S, seed: int = 0) -> paddle.Tensor:
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.integers(0, 260, (batch, seq)), dtype="int64")


def _pos(batch: int, start: int, stop: int) -> paddle.Tensor:
    return paddle.arange(start, stop, dtype="int64").unsqueeze(0).expand([batch, stop - start])


def _causal(batch: int = B, seq: int = S) -> AttentionContext:
    return AttentionContext(mask=masks.causal_mask(batch, seq).indices, causal=True)


# ------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("name", ARCH_PRESETS)
def test_forward_shapes_and_dtype(name: str) -> None:
    model = _model(name)
    hidden = model(_ids(), _pos(B, 0, S), _causal())  # final-norm hidden states
    assert list(hidden.shape) == [B, S, 64]
    np.testing.assert_array_equal(
        hidden.numpy(), model.hidden_states(_ids(), _pos(B, 0, S), _causal()).numpy()
    )
    logits = model.logits(hidden)
    assert list(logits.shape) == [B, S, 260] and logits.dtype == paddle.float32
    assert np.isfinite(logits.numpy()).all()


@pytest.mark.parametrize(("heads", "kv"), [(4, 4), (4, 2), (4, 1)])
def test_gqa_projection_shapes(heads: int, kv: int) -> None:
    model = _model("tiny_glm", num_heads=heads, num_kv_heads=kv)
    attn = model.model.layers[0].self_attn
    hd = 64 // heads
    assert list(attn.q_proj.weight.shape) == [64, heads * hd]
    assert list(attn.k_proj.weight.shape) == [64, kv * hd]
    assert list(attn.v_proj.weight.shape) == [64, kv * hd]
    assert list(model.logits(model(_ids(), _pos(B, 0, S), _causal())).shape) == [B, S, 260]


def test_explicit_head_dim() -> None:
    model = _model("tiny_glm", head_dim=32)
    assert list(model.model.layers[0].self_attn.q_proj.weight.shape) == [64, 4 * 32]
    assert list(model.logits(model(_ids(), _pos(B, 0, S), _causal())).shape) == [B, S, 260]


def test_tied_embeddings_share_one_matrix() -> None:
    model = _model("tiny_glm", tie_embeddings=True)
    assert model.lm_head is None
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names
    hidden = model.hidden_states(_ids(), _pos(B, 0, S), _causal())
    table = model.model.embed_tokens.weight.numpy().astype(np.float64)
    want = hidden.numpy() @ table.T  # in float64
    # float32 logits vs float64: the float32 rule (bench.numerics), n = the hidden size
    numerics.assert_close(model.logits(hidden).numpy(), want, n=64, what="tied logits")
    # negative control: the same seed untied (its own lm_head) gives other logits
    with paddle.no_grad():
        untied = _model("tiny_glm").logits(hidden).numpy()
    numerics.assert_rejects(untied, want, n=64)
    model.logits(model(_ids(), _pos(B, 0, S), _causal())).mean().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_parameter_count_matches_estimate() -> None:
    for name in [*ARCH_PRESETS, "small"]:
        for tie in (False, True):
            args = preset(name, tie_embeddings=tie)
            model = _model(name, tie_embeddings=tie)
            n = sum(int(np.prod(p.shape)) for p in model.parameters())
            assert n == estimate_parameters(args), name
    learned = preset("tiny", position="learned")
    n = sum(int(np.prod(p.shape)) for p in build_model(learned).parameters())
    assert n == estimate_parameters(learned)
    qk = preset("tiny_glm_moe", use_qk_norm=True)
    model = build_model(qk)
    n = sum(int(np.prod(p.shape)) for p in model.parameters())
    assert n == estimate_parameters(qk) == estimate_parameters(preset("tiny_glm_moe")) + 2 * 2 * 16
    assert list(model.model.layers[0].self_attn.q_norm.weight.shape) == [16]  # one head


def test_glm_layer_structure() -> None:
    dense = _model("tiny_glm").model.layers[0]
    assert isinstance(dense, Block)
    assert hasattr(dense, "post_self_attn_layernorm") and hasattr(dense, "post_mlp_layernorm")
    assert dense.mlp.fused and dense.self_attn.q_proj.bias is not None
    moe = _model("tiny_glm_moe").model.layers
    assert not hasattr(moe[0], "post_self_attn_layernorm")
    assert not moe[0].mlp.fused and not isinstance(moe[0].mlp, MoE)
    assert isinstance(moe[1].mlp, MoE)


# ---------------------------------------------------------------------------- positions


def _hf_interleaved(x: np.ndarray, pos: np.ndarray, rot: int, base: float) -> np.ndarray:
    """HF Glm4 apply_rotary_pos_emb: cos[..., :half].repeat_interleave(2), even/odd pairs."""
    inv = 1.0 / base ** (np.arange(0, rot, 2) / rot)
    freqs = pos[..., None] * inv  # [B, L, rot/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos = np.repeat(np.cos(emb)[..., : rot // 2], 2, axis=-1)[:, :, None]
    sin = np.repeat(np.sin(emb)[..., : rot // 2], 2, axis=-1)[:, :, None]
    xr, xp = x[..., :rot], x[..., rot:]
    turned = np.stack([-xr[..., 1::2], xr[..., 0::2]], axis=-1).reshape(xr.shape)
    return np.concatenate([xr * cos + turned * sin, xp], axis=-1)


def _hf_half_split(x: np.ndarray, pos: np.ndarray, rot: int, base: float) -> np.ndarray:
    """HF GPT-NeoX/Glm4Moe apply_rotary_pos_emb on the first `rot` dims."""
    inv = 1.0 / base ** (np.arange(0, rot, 2) / rot)
    emb = np.concatenate([pos[..., None] * inv] * 2, axis=-1)
    cos, sin = np.cos(emb)[:, :, None], np.sin(emb)[:, :, None]
    xr, xp = x[..., :rot], x[..., rot:]
    turned = np.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], axis=-1)
    return np.concatenate([xr * cos + turned * sin, xp], axis=-1)


@pytest.mark.parametrize(("interleaved", "rot"), [(True, 8), (False, 8), (False, 16), (True, 16)])
def test_rotary_matches_hf_conventions(interleaved: bool, rot: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, (2, 5))
    tables = rotary_tables(
        paddle.to_tensor(pos), inverse_frequencies(rot, 10000.0), interleaved=interleaved
    )
    got = apply_rotary(paddle.to_tensor(x), tables).numpy()
    ref = _hf_interleaved if interleaved else _hf_half_split
    want = ref(x.astype(np.float64), pos.astype(np.float64), rot, 10000.0)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)  # float32 angles up to 5000


def test_arch_rotary_defaults() -> None:
    assert preset("tiny_glm").interleaved_rotary
    assert not preset("tiny_glm_moe").interleaved_rotary
    assert not preset("tiny").interleaved_rotary
    assert preset("tiny_glm").rotary_dim == 8  # head_dim 16 × 0.5
    assert preset("tiny", position="learned").rotary_dim == 0


@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("name", "overrides"),
    [("tiny", {}), ("tiny", {"position": "learned"}), ("tiny_glm", {}), ("tiny_glm_moe", {})],
)
def test_two_halves_with_global_positions_equal_one_pass(name: str, overrides: dict) -> None:
    """Two documents packed in one sequence vs each run alone at its GLOBAL positions."""
    model = _model(name, **overrides)
    ids, half = _ids(), S // 2
    doc = AttentionContext(
        mask=masks.causal_document_mask([half, half], batch=B).indices, causal=True
    )
    full = model(ids, _pos(B, 0, S), doc).numpy()
    first = model(ids[:, :half], _pos(B, 0, half), _causal(B, half)).numpy()
    second = model(ids[:, half:], _pos(B, half, S), _causal(B, half)).numpy()
    # another tiling of the same attention sums: the float32 rule, n = the S keys
    numerics.assert_close(full[:, :half], first, n=S, what="first document")
    numerics.assert_close(full[:, half:], second, n=S, what="second document")
    # negative control: the second document's rows are not the first's
    numerics.assert_rejects(full[:, half:], first, n=S)
    if overrides.get("position") == "learned":  # positions really are used
        wrong = model(ids[:, half:], _pos(B, 0, half), _causal(B, half)).numpy()
        numerics.assert_rejects(wrong, second, n=S)


def test_rotary_positions_change_the_output() -> None:
    model = _model("tiny_glm")
    ids = _ids()
    base = model(ids, _pos(B, 0, S), _causal()).numpy()
    shuffled = paddle.to_tensor(np.random.default_rng(0).permutation(S)[None].repeat(B, 0))
    other = model(ids, shuffled, _causal()).numpy()
    assert np.abs(other - base).max() > 1e-3


def test_learned_position_beyond_max_seq_len_raises() -> None:
    model = _model("tiny", position="learned", max_seq_len=32)
    with pytest.raises(ValueError, match="max_seq_len 32"):
        model(_ids(B, 8), _pos(B, 30, 38), _causal(B, 8))


def test_mask_as_paddle_tensor_or_numpy() -> None:
    model = _model("tiny_glm")
    idx = masks.causal_document_mask([10, 22], batch=B).indices
    a = model(_ids(), _pos(B, 0, S), AttentionContext(mask=idx, causal=True)).numpy()
    t = paddle.to_tensor(idx)
    b = model(_ids(), _pos(B, 0, S), AttentionContext(mask=t, causal=True)).numpy()
    np.testing.assert_array_equal(a, b)


@pytest.mark.equivalence
def test_forced_cp_path_single_rank_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CP call path (plan, all-gather-KV PyLayer) at one rank equals the plain path."""
    model = _model("tiny_glm_moe")
    ctx = AttentionContext(mask=masks.causal_document_mask([12, 20], batch=B).indices, causal=True)
    plain = model(_ids(), _pos(B, 0, S), ctx).numpy()
    monkeypatch.setattr(cp_modes, "implementation_for", lambda c: cp_modes.implementation(c.mode))
    cp = model(_ids(), _pos(B, 0, S), ctx).numpy()
    numerics.assert_close(cp, plain, n=S, what="cp path logits")  # bench.numerics


def test_input_errors() -> None:
    model = _model("tiny")
    with pytest.raises(TypeError, match="AttentionContext"):
        model(_ids(), _pos(B, 0, S), masks.causal_mask(B, S))
    with pytest.raises(ValueError, match="must match input_ids"):
        model(_ids(), _pos(B, 0, S - 1), _causal())
    with pytest.raises(ValueError, match=r"\[batch, local_seq\]"):
        model(_ids()[0], _pos(B, 0, S), _causal())


# ---------------------------------------------------------------------------- log-probs


def test_token_logprobs() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32)
    labels = rng.integers(0, 7, (2, 5))
    labels[0, 1] = labels[1, 4] = -100
    got = token_logprobs(paddle.to_tensor(logits), paddle.to_tensor(labels)).numpy()
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)  # reference: float64
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
    want[labels == -100] = 0.0
    assert got.shape == (2, 5)
    # float32 vs float64: the float32 rule (bench.numerics), n = the vocabulary (the sum of
    # the log-softmax), scale = max |log-prob|
    numerics.assert_close(got, want, n=7, what="token log-probs")
    # negative control: the logit itself, not normalised by the log-sum-exp
    raw = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
    numerics.assert_rejects(np.where(labels == -100, 0.0, raw), want, n=7)


# --------------------------------------------------------------------- presets, validate


def test_real_presets_validate_everywhere_but_build_only_on_gpu() -> None:
    air, glm9 = preset("glm45_air"), preset("glm4_9b")
    assert air.problems() == [] and glm9.problems() == []
    assert (air.num_layers, air.hidden_size, air.num_heads, air.num_kv_heads) == (46, 4096, 96, 8)
    assert (air.num_experts, air.num_experts_per_tok, air.first_k_dense_replace) == (128, 8, 1)
    assert air.mtp_layers == 1  # its NextN layer: a MoE block, embedding, head (~3.6B)
    assert 105e9 < estimate_parameters(dataclasses.replace(air, mtp_layers=0)) < 108e9  # "106B"
    assert 110e9 < estimate_parameters(air) < 111e9
    assert 9.0e9 < estimate_parameters(glm9) < 9.6e9
    if paddle.get_device() == "cpu":
        with pytest.raises(ValueError, match="built only on GPU"):
            build_model(air)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="tiny_glm"):
        preset("huge")


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        ({"num_heads": 6, "num_kv_heads": 4, "head_dim": 16}, "model.num_heads", "num_heads 6"),
        ({"num_heads": 3, "num_kv_heads": 3}, "model.head_dim", "not a multiple of num_heads 3"),
        ({"partial_rotary_factor": 0.1}, "model.partial_rotary_factor", "even"),
        ({"position": "learned"}, "model.position", "always uses rotary"),
        ({"vocab_size": 0}, "model.vocab_size", "positive integer"),
        ({"recompute": "some"}, "model.recompute", "none, full, refined"),
        ({"norm_eps": 0.0}, "model.norm_eps", "> 0"),
        ({"arch": "mistral"}, "model.arch", "gpt, glm, glm_moe, ernie4_5"),
    ],
)
def test_validate_messages(overrides: dict, key: str, text: str) -> None:
    args = dataclasses.replace(preset("tiny_glm"), **overrides)
    errs = args.problems()
    assert any(e.key == key and text in e.problem for e in errs), errs
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        args.check()


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        ({"num_experts_per_tok": 5}, "model.num_experts_per_tok", "exceeds num_experts 4"),
        ({"first_k_dense_replace": 3}, "model.first_k_dense_replace", "[0, num_layers=2]"),
        ({"num_experts": 0}, "model.num_experts", "positive integer"),
        ({"routed_scaling_factor": 0.0}, "model.routed_scaling_factor", "> 0"),
        ({"num_shared_experts": -1}, "model.num_shared_experts", ">= 0"),
    ],
)
def test_validate_moe_messages(overrides: dict, key: str, text: str) -> None:
    errs = dataclasses.replace(preset("tiny_glm_moe"), **overrides).problems()
    assert any(e.key == key and text in e.problem for e in errs), errs


def test_validate_reports_every_problem_and_moe_fields_on_dense() -> None:
    args = ModelArgs(arch="gpt", num_heads=6, num_kv_heads=4, hidden_size=60, num_experts=8)
    keys = {e.key for e in args.problems()}
    assert {"model.num_heads", "model.num_experts"} <= keys
    assert preset("tiny").problems() == []


@pytest.mark.equivalence
def test_no_mask_means_causal_flag_alone() -> None:
    model = _model("tiny_glm")
    a = model(_ids(), _pos(B, 0, S), _causal()).numpy()
    b = model(_ids(), _pos(B, 0, S), AttentionContext(mask=None, causal=True)).numpy()
    numerics.assert_close(a, b, n=S, what="logits")  # another tiling plan, same sums


def test_cp_only_with_more_than_one_rank() -> None:
    class Group:
        def __init__(self, n: int) -> None:
            self.nranks = n

    assert not AttentionContext(mask=None, causal=True).uses_cp
    assert not AttentionContext(mask=None, causal=True, group=Group(1)).uses_cp
    assert AttentionContext(mask=None, causal=True, group=Group(2)).uses_cp


def test_float_positions_rejected_and_rotary_override() -> None:
    model = _model("tiny")
    with pytest.raises(TypeError, match="positions must be int64"):
        model(_ids(), _pos(B, 0, S).astype("float32"), _causal())
    assert preset("tiny_glm", rotary_interleaved=False).interleaved_rotary is False
