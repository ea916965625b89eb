"""HF safetensors: checkpoints written here with numpy in the GLM-4 / GLM-4.5 layouts load and
reproduce an independent numpy forward with HF semantics; save → load round-trips bitwise;
missing / unexpected keys and shape mismatches are named before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import save_file as np_save_file
from safetensors.paddle import save_file as pd_save_file

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.models import ModelArgs, build_model, preset
from flashcp.models.hf_check import CheckpointMismatchError
from flashcp.models.hf_config import args_from_hf_config
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.models.hf_save import save_hf_checkpoint

SMALL = dict(
    vocab_size=40,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    partial_rotary_factor=0.5,
    qkv_bias=True,
    max_seq_len=64,
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    num_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.7,
)
B, S = 2, 12


def _args(arch: str, **overrides) -> ModelArgs:
    extra = MOE if arch == "glm_moe" else {}
    return ModelArgs(arch=arch, **{**SMALL, **extra, **overrides}).check()


# ------------------------------------------------------------ HF-layout weights, by hand


def hf_weights(args: ModelArgs, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under HF ``Glm4ForCausalLM`` / ``Glm4MoeForCausalLM`` keys and shapes."""
    rng = np.random.default_rng(seed)
    H, hd, inter = args.hidden_size, args.head_size, args.intermediate_size
    nq, nkv = args.num_heads * hd, args.num_kv_heads * hd

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.15).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.standard_normal(H) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(args.vocab_size, H), "model.norm.weight": norm()}
    w["lm_head.weight"] = mat(args.vocab_size, H)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
        for name, rows in (("q", nq), ("k", nkv), ("v", nkv)):
            w[p + f"self_attn.{name}_proj.weight"] = mat(rows, H)
            w[p + f"self_attn.{name}_proj.bias"] = mat(rows)
        w[p + "self_attn.o_proj.weight"] = mat(H, nq)
        if args.use_qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm()[:hd] * 1.5
            w[p + "self_attn.k_norm.weight"] = norm()[:hd] * 0.7
        if args.arch == "glm":
            w[p + "post_self_attn_layernorm.weight"] = norm()
            w[p + "post_mlp_layernorm.weight"] = norm()
            w[p + "mlp.gate_up_proj.weight"] = mat(2 * inter, H)
            w[p + "mlp.down_proj.weight"] = mat(H, inter)
        elif not args.is_moe_layer(i):
            for name in ("gate_proj", "up_proj"):
                w[p + f"mlp.{name}.weight"] = mat(inter, H)
            w[p + "mlp.down_proj.weight"] = mat(H, inter)
        else:
            m = args.moe_intermediate_size
            w[p + "mlp.gate.weight"] = mat(args.num_experts, H) * 4
            w[p + "mlp.gate.e_score_correction_bias"] = mat(args.num_experts)
            experts = [f"experts.{j}" for j in range(args.num_experts)]
            for prefix, width in [(e, m) for e in experts] + [
                ("shared_experts", m * args.num_shared_experts)
            ]:
                w[p + f"mlp.{prefix}.gate_proj.weight"] = mat(width, H)
                w[p + f"mlp.{prefix}.up_proj.weight"] = mat(width, H)
                w[p + f"mlp.{prefix}.down_proj.weight"] = mat(H, width)
    return w


def _rms(x: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, rot: int, interleaved: bool, base: float = 10000.0) -> np.ndarray:
    pos = np.arange(x.shape[1], dtype=np.float64)
    freqs = pos[:, None] * (1.0 / base ** (np.arange(0, rot, 2) / rot))  # [L, rot/2]
    xr, xp = x[..., :rot], x[..., rot:]
    if interleaved:  # HF Glm4: pairs (2i, 2i+1)
        cos = np.repeat(np.cos(freqs), 2, -1)[None, :, None]
        sin = np.repeat(np.sin(freqs), 2, -1)[None, :, None]
        turned = np.stack([-xr[..., 1::2], xr[..., 0::2]], -1).reshape(xr.shape)
    else:  # HF Glm4Moe (GPT-NeoX): pairs (i, i + rot/2)
        cos = np.concatenate([np.cos(freqs)] * 2, -1)[None, :, None]
        sin = np.concatenate([np.sin(freqs)] * 2, -1)[None, :, None]
        turned = np.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return np.concatenate([xr * cos + turned * sin, xp], -1)


def _mlp(w: dict, p: str, h: np.ndarray) -> np.ndarray:
    g, u = h @ w[p + "gate_proj.weight"].T, h @ w[p + "up_proj.weight"].T
    return (_silu(g) * u) @ w[p + "down_proj.weight"].T


def reference_logits(
    w: dict[str, np.ndarray], args: ModelArgs, ids: np.ndarray, *, qk_norm_after_rope: bool = False
) -> np.ndarray:
    """HF GLM-4 / GLM-4.5 forward in float64 numpy, dense causal attention (QK-norm per head
    before rotary, as HF ``Glm4MoeAttention``; `qk_norm_after_rope` is a wrong-order control)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b, s = ids.shape
    hd, nh, nkv = args.head_size, args.num_heads, args.num_kv_heads
    x = w["model.embed_tokens.weight"][ids]
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (
            (h @ w[p + f"self_attn.{n}_proj.weight"].T + w[p + f"self_attn.{n}_proj.bias"]).reshape(
                b, s, -1, hd
            )
            for n in ("q", "k", "v")
        )
        qn, kn = w.get(p + "self_attn.q_norm.weight"), w.get(p + "self_attn.k_norm.weight")
        if args.use_qk_norm and not qk_norm_after_rope:
            q, k = _rms(q, qn), _rms(k, kn)
        q, k = (_rope(t, args.rotary_dim, args.arch == "glm", args.rotary_base) for t in (q, k))
        if args.use_qk_norm and qk_norm_after_rope:
            q, k = _rms(q, qn), _rms(k, kn)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = np.where(np.triu(np.ones((s, s), bool), 1), -np.inf, scores)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
        o = o @ w[p + "self_attn.o_proj.weight"].T
        if args.arch == "glm":
            o = _rms(o, w[p + "post_self_attn_layernorm.weight"])
        x = x + o
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        if args.arch == "glm":
            gate, up = np.split(h @ w[p + "mlp.gate_up_proj.weight"].T, 2, axis=-1)
            m = _rms(
                (_silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T,
                w[p + "post_mlp_layernorm.weight"],
            )
        elif not args.is_moe_layer(i):
            m = _mlp(w, p + "mlp.", h)
        else:
            flat = h.reshape(-1, h.shape[-1])
            scores = 1.0 / (1.0 + np.exp(-(flat @ w[p + "mlp.gate.weight"].T)))
            choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
            m = _mlp(w, p + "mlp.shared_experts.", flat)
            for t in range(flat.shape[0]):
                top = np.argsort(-choice[t])[: args.num_experts_per_tok]
                wt = scores[t, top] / scores[t, top].sum() * args.routed_scaling_factor
                for e, we in zip(top, wt, strict=True):
                    m[t] += we * _mlp(w, p + f"mlp.experts.{e}.", flat[t : t + 1])[0]
            m = m.reshape(h.shape)
        x = x + m
    x = _rms(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T


def _forward(model, ids: np.ndarray) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=masks.causal_mask(b, s).indices, causal=True)
    hidden = model(paddle.to_tensor(ids, dtype="int64"), pos, ctx)
    return model.logits(hidden).numpy()


def _ids(vocab: int = 40) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, (B, S))


# ---------------------------------------------------------------------------- loading


def test_load_glm4_single_file_matches_hf_reference(tmp_path: Path) -> None:
    args = _args("glm")
    w = hf_weights(args)
    np_save_file(w, str(tmp_path / "model.safetensors"))
    model = build_model(args)
    report = load_hf_checkpoint(model, tmp_path)
    assert sorted(report.loaded) == sorted(w) and report.skipped == []
    q = model.model.layers[1].self_attn.q_proj.weight.numpy()
    np.testing.assert_array_equal(q, w["model.layers.1.self_attn.q_proj.weight"].T)
    assert not model.model.layers[1].self_attn.q_proj.weight.stop_gradient  # still trainable
    np.testing.assert_allclose(
        _forward(model, _ids()), reference_logits(w, args, _ids()), rtol=1e-4, atol=1e-4
    )


def test_load_glm45_sharded_skips_mtp_layer_and_matches_reference(tmp_path: Path) -> None:
    args = _args("glm_moe")
    w = hf_weights(args)
    mtp = {  # GLM-4.5's multi-token-prediction layer: this model (mtp_layers 0) skips it
        "model.layers.2.eh_proj.weight": np.zeros((32, 64), np.float32),
        "model.layers.2.enorm.weight": np.ones(32, np.float32),
    }
    keys = sorted(w)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2]}
    shards["model-00002-of-00002.safetensors"] = keys[len(keys) // 2 :]
    for name, part in shards.items():
        tensors = {k: w[k] for k in part}
        if name.startswith("model-00002"):
            tensors.update(mtp)
        np_save_file(tensors, str(tmp_path / name))
    weight_map = {k: n for n, part in shards.items() for k in part}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in mtp})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = build_model(args)
    report = load_hf_checkpoint(model, tmp_path)
    assert sorted(report.skipped) == sorted(mtp) and len(report.files) == 2
    assert report.skipped_mtp == [2]
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
    np.testing.assert_array_equal(bias, w["model.layers.1.mlp.gate.e_score_correction_bias"])
    np.testing.assert_allclose(
        _forward(model, _ids()), reference_logits(w, args, _ids()), rtol=1e-4, atol=1e-4
    )


def test_glm45_qk_norm_and_rope_theta_match_reference(tmp_path: Path) -> None:
    """GLM-4.5's QK-norm (per head, before rotary) with a non-default rope_theta; the same
    weights through a wrong-order reference (norm after rotary) are far outside the tolerance."""
    args = _args("glm_moe", use_qk_norm=True, rotary_base=50_000.0)
    w = hf_weights(args)
    assert "model.layers.0.self_attn.q_norm.weight" in w
    np_save_file(w, str(tmp_path / "model.safetensors"))
    model = build_model(args)
    report = load_hf_checkpoint(model, tmp_path)
    assert sorted(report.loaded) == sorted(w)
    got = _forward(model, _ids())
    np.testing.assert_allclose(got, reference_logits(w, args, _ids()), rtol=1e-4, atol=1e-4)
    wrong = reference_logits(w, args, _ids(), qk_norm_after_rope=True)
    assert np.abs(got - wrong).max() > 100 * 1e-4
    with pytest.raises(CheckpointMismatchError, match="q_norm"):  # a model without QK-norm
        load_hf_checkpoint(build_model(_args("glm_moe", rotary_base=50_000.0)), tmp_path)


def test_tied_model_skips_lm_head(tmp_path: Path) -> None:
    args = _args("glm", tie_embeddings=True)
    np_save_file(hf_weights(args), str(tmp_path / "weights.safetensors"))
    report = load_hf_checkpoint(build_model(args), tmp_path / "weights.safetensors")
    assert report.skipped == ["lm_head.weight"]


def test_bf16_checkpoint_loads_into_float32(tmp_path: Path) -> None:
    args = _args("glm")
    w = hf_weights(args)
    bf16 = {k: paddle.to_tensor(v).astype("bfloat16") for k, v in w.items()}
    pd_save_file(bf16, str(tmp_path / "model.safetensors"))
    model = build_model(args)
    load_hf_checkpoint(model, tmp_path)
    got = model.model.embed_tokens.weight
    assert got.dtype == paddle.float32
    want = bf16["model.embed_tokens.weight"].astype("float32").numpy()
    np.testing.assert_array_equal(got.numpy(), want)


# ---------------------------------------------------------------------------- errors


def _write(tmp_path: Path, w: dict[str, np.ndarray]) -> Path:
    path = tmp_path / "model.safetensors"
    np_save_file(w, str(path))
    return path


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path: Path) -> None:
    args = _args("glm")
    w = hf_weights(args)
    del w["model.layers.0.mlp.down_proj.weight"]
    w["model.layers.0.self_attn.rotary.extra"] = np.zeros(3, np.float32)
    w["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    model = build_model(args)
    before = model.model.embed_tokens.weight.numpy().copy()
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(model, _write(tmp_path, w))
    text = str(info.value)
    assert "missing from the checkpoint (1)" in text
    assert "model.layers.0.mlp.down_proj.weight" in text
    assert "unexpected in the checkpoint (1)" in text and "rotary.extra" in text
    assert "model.layers.1.self_attn.k_proj.weight: checkpoint [8, 32] vs model [16, 32]" in text
    np.testing.assert_array_equal(model.model.embed_tokens.weight.numpy(), before)


def test_non_strict_ignores_unexpected_keys(tmp_path: Path) -> None:
    args = _args("glm")
    w = hf_weights(args)
    w["extra.weight"] = np.zeros(2, np.float32)
    report = load_hf_checkpoint(build_model(args), _write(tmp_path, w), strict=False)
    assert report.skipped == ["extra.weight"]


def test_path_errors(tmp_path: Path) -> None:
    model = build_model(_args("glm"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(model, tmp_path / "nope")
    np_save_file({"a": np.zeros(1, np.float32)}, str(tmp_path / "a.safetensors"))
    np_save_file({"b": np.zeros(1, np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(FileNotFoundError, match="2 other .safetensors"):
        load_hf_checkpoint(model, tmp_path)


# ---------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "args",
    [
        preset("tiny", position="learned", tie_embeddings=True),
        preset("tiny", qkv_bias=True),
        _args("glm"),
        _args("glm_moe"),
    ],
    ids=["gpt-learned-tied", "gpt-rotary", "glm", "glm_moe"],
)
@pytest.mark.parametrize("shard", [None, 20_000])
def test_save_load_round_trip_bitwise(tmp_path: Path, args: ModelArgs, shard) -> None:
    paddle.seed(0)
    source = build_model(args)
    if args.arch == "glm_moe":  # make the buffer non-trivial
        bias = source.model.layers[1].mlp.gate.e_score_correction_bias
        paddle.assign(paddle.to_tensor([0.1, -0.2, 0.3, 0.0]), output=bias)
    files = save_hf_checkpoint(source, tmp_path, max_shard_bytes=shard)
    assert (len(files) > 1) == (shard is not None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    paddle.seed(1)
    target = build_model(args_from_hf_config(tmp_path))
    assert target.args == args
    load_hf_checkpoint(target, tmp_path)
    want, got = source.state_dict(), target.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key].numpy(), want[key].numpy(), err_msg=key)
    ids = _ids(args.vocab_size)
    np.testing.assert_array_equal(_forward(target, ids), _forward(source, ids))


def test_resave_removes_stale_shards(tmp_path: Path) -> None:
    model = build_model(_args("glm"))
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=10_000)
    save_hf_checkpoint(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_saved_keys_are_the_hf_layout(tmp_path: Path) -> None:
    args = _args("glm_moe")
    save_hf_checkpoint(build_model(args), tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        assert list(f.get_slice("model.layers.1.mlp.gate.weight").get_shape()) == [4, 32]
    assert keys == set(hf_weights(args))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["n_routed_experts"] == 4 and config["first_k_dense_replace"] == 1


# ---------------------------------------------------------------------------- HF configs


AIR_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "use_qk_norm": False,
    "vocab_size": 151552,
}


def test_hf_air_config_gives_the_preset() -> None:
    # with its multi-token-prediction layer (num_nextn_predict_layers 1)
    assert args_from_hf_config(AIR_CONFIG) == preset("glm45_air", mtp_layers=1)
    full = args_from_hf_config({**AIR_CONFIG, "use_qk_norm": True})  # GLM-4.5 (not Air)
    assert full == preset("glm45_air", use_qk_norm=True, mtp_layers=1)
    with pytest.raises(ValueError, match="'mistral' is not supported"):
        args_from_hf_config({**AIR_CONFIG, "model_type": "mistral", "architectures": None})
