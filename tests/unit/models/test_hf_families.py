"""The new families' config.json files as their publishers wrote them (verbatim key sets of
Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B, Qwen3-30B-A3B and ERNIE-4.5-0.3B's remote-code upload; an
ERNIE-4.5-21B-A3B file from its published values; PaddleFormers' own ERNIE-4.5 MoE save) read
to exactly the shipped presets of those models; what each family refuses, naming the key;
and every preset of every family written by `hf_config` and read back unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from flashcp.models import ModelArgs, preset
from flashcp.models.families import FAMILIES
from flashcp.models.hf_config import HFConfigError, args_from_hf_config, hf_config
from flashcp.models.rope import inverse_frequencies, llama3_scaled, model_inverse_frequencies

LLAMA31_8B: dict[str, Any] = {  # transformers 4.43 era file of meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip
ERNIE_03B: dict[str, Any] = {  # baidu/ERNIE-4.5-0.3B-PT, the remote-code upload
    "architectures": ["Ernie4_5_ForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_ernie4_5.Ernie4_5_Config",
                 "AutoModel": "modeling_ernie4_5.Ernie4_5_Model",
                 "AutoModelForCausalLM": "modeling_ernie4_5.Ernie4_5_ForCausalLM"},
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 1024,
    "intermediate_size": 3072, "max_position_embeddings": 131072, "model_type": "ernie4_5",
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
    "num_hidden_layers": 18, "pad_token_id": 0, "rms_norm_eps": 1e-05, "use_cache": False,
    "vocab_size": 103424, "rope_theta": 500000, "use_bias": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}  # fmt: skip
ERNIE_21B: dict[str, Any] = {  # ERNIE-4.5-21B-A3B's published values, ERNIE's extra keys
    "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "ernie4_5_moe",
    "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "use_cache": False, "vocab_size": 103424,
    "rope_theta": 500000.0, "use_rmsnorm": True, "use_bias": False, "moe_num_experts": 64,
    "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27,
    "moe_layer_interval": 1, "moe_intermediate_size": 1536, "moe_capacity": [64, 64, 64],
    "moe_gate": "topk", "moe_k": 6, "moe_use_aux_free": True, "num_nextn_predict_layers": 1,
    "multi_token_pred_lambda": 0.3, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # fmt: skip
PADDLEFORMERS_ERNIE_MOE: dict[str, Any] = {  # PaddleFormers 1.2.0 save_pretrained, tiny
    "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "head_dim": 8, "hidden_act": "silu", "hidden_size": 16,
    "initializer_range": 0.1443303502386106, "intermediate_size": 32,
    "max_position_embeddings": 256, "model_type": "ernie4_5_moe", "moe_capacity": [64, 64, 64],
    "moe_intermediate_size": 8, "moe_k": 2, "moe_layer_end_index": 2, "moe_layer_interval": 1,
    "moe_layer_start_index": 1, "moe_num_experts": 4, "moe_num_shared_experts": 2,
    "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "num_nextn_predict_layers": 0, "pad_token_id": 0, "paddleformers_version": "1.2.0",
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    "use_bias": False, "use_cache": False, "vocab_size": 64,
}  # fmt: skip
MODEL_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim_value", "intermediate_size", "rotary_base", "norm_eps", "tie_embeddings",
              "qkv_bias", "o_bias", "mlp_bias", "use_qk_norm", "rope_scaling", "rope_factor",
              "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "num_shared_experts", "first_k_dense_replace", "moe_layer_end",
              "moe_layer_interval", "mlp_only_layers", "norm_topk_prob",
              "interleaved_rotary", "matmul_weights")  # fmt: skip


def _model(args: ModelArgs) -> dict[str, Any]:
    """What decides the computed model (not max_seq_len, a run choice in the presets)."""
    out = {}
    for key in MODEL_KEYS:
        value = args.head_size if key == "head_dim_value" else getattr(args, key)
        out[key] = value() if callable(value) else value
    out["moe_layers"] = [i for i in range(args.num_layers) if args.is_moe_layer(i)]
    return out


@pytest.mark.parametrize(
    ("config", "name"),
    [(LLAMA31_8B, "llama31_8b"), (QWEN25_7B, "qwen25_7b"), (QWEN3_8B, "qwen3_8b"),
     (QWEN3_30B_A3B, "qwen3_30b_a3b"), (ERNIE_03B, "ernie45_0p3b"),
     (ERNIE_21B, "ernie45_21b_a3b")],  # fmt: skip
)
def test_a_published_config_reads_as_its_preset(config: dict[str, Any], name: str) -> None:
    args = args_from_hf_config(config)
    assert _model(args) == _model(preset(name))
    assert args.arch == preset(name).arch


def test_the_moe_layers_follow_each_family_rule() -> None:
    """ERNIE: start ≤ i ≤ end with (i + 1) % interval == 0; Qwen3-MoE: (i + 1) % step == 0
    and not in mlp_only_layers."""
    ernie = args_from_hf_config({**ERNIE_21B, "moe_layer_start_index": 3,
                                 "moe_layer_end_index": 20, "moe_layer_interval": 2})  # fmt: skip
    assert [i for i in range(28) if ernie.is_moe_layer(i)] == list(range(3, 21, 2))
    qwen = args_from_hf_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2,
                                "mlp_only_layers": [3, 7]})  # fmt: skip
    moe = [i for i in range(48) if qwen.is_moe_layer(i)]
    assert moe == [i for i in range(1, 48, 2) if i not in (3, 7)]
    assert qwen.mlp_only_layers == (3, 7)
    # -1: the last layer (transformers resolves it), written back resolved
    end = args_from_hf_config({**ERNIE_21B, "moe_layer_end_index": -1})
    assert end.moe_layer_end == 27 and hf_config(end)["moe_layer_end_index"] == 27


def test_paddleformers_ernie_moe_directory_reads_with_a_note() -> None:
    from flashcp.models.hf_config import parse_hf_config

    values, notes = parse_hf_config(PADDLEFORMERS_ERNIE_MOE)
    assert values["arch"] == "ernie4_5_moe" and values["tie_embeddings"] is True
    assert values["moe_layer_end"] == 2 and values["first_k_dense_replace"] == 1
    assert any("moe_capacity" in n and "paddleformers_version" in n for n in notes), notes


def test_qwen3_moe_reads_transformers_5_num_local_experts() -> None:
    five = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert args_from_hf_config({**five, "num_local_experts": 64}).num_experts == 64


REFUSALS = [
    (QWEN25_7B, {"use_sliding_window": True}, "use_sliding_window"),
    (QWEN3_8B, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    (QWEN25_7B, {"use_mrope": True}, "use_mrope"),
    (ERNIE_21B, {"use_bias": True}, "use_bias"),
    (ERNIE_21B, {"use_rmsnorm": False}, "use_rmsnorm"),
    (QWEN3_30B_A3B, {"num_local_experts": 64}, "num_local_experts"),
    (QWEN3_30B_A3B, {"mlp_only_layers": "none"}, "mlp_only_layers"),
    (LLAMA31_8B, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    (LLAMA31_8B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    (QWEN3_8B, {"qk_layernorm": True}, "config.json"),
    (ERNIE_03B, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
]


@pytest.mark.parametrize(("config", "change", "key"), REFUSALS)
def test_each_family_refuses_what_it_does_not_compute(
    config: dict[str, Any], change: dict[str, Any], key: str
) -> None:
    with pytest.raises(HFConfigError) as info:
        args_from_hf_config({**config, **change})
    assert any(key in k for k, _ in info.value.problems), info.value.problems


def test_a_fixed_value_set_otherwise_in_the_run_config_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"qkv_bias=True; set model.qkv_bias: true"):
        dataclasses.replace(preset("tiny_qwen2"), qkv_bias=False).check()
    with pytest.raises(ValueError, match=r"sets qkv_bias and o_bias together"):
        dataclasses.replace(preset("tiny_llama"), o_bias=True).check()
    with pytest.raises(ValueError, match=r"o_bias=False; set model.o_bias: false"):
        dataclasses.replace(preset("tiny_qwen2"), o_bias=True).check()
    with pytest.raises(ValueError, match=r"dense_replace=0; set model.first_k_dense_replace: 0"):
        dataclasses.replace(preset("tiny_qwen3_moe"), first_k_dense_replace=1).check()


@pytest.mark.parametrize(
    "name", [n for fam in FAMILIES.values() if fam.hf and fam.hf.transformers
             for n in fam.presets]  # fmt: skip
)
def test_every_preset_round_trips_through_config_json(name: str) -> None:
    args = preset(name)
    again = args_from_hf_config(hf_config(args))
    assert _model(again) == _model(args)


@pytest.mark.parametrize(("low", "high"), [(1.0, 4.0), (2.0, 4.0), (1.0, 8.0)])
def test_llama3_scaling_equals_its_definition(low: float, high: float) -> None:
    """Llama-3.1's published rule (float64 here): a wavelength above original / low is
    slowed by `factor`, below original / high kept, between interpolated by
    s = (original / wavelength - low) / (high - low)."""
    inv = inverse_frequencies(128, 500000.0).astype(np.float64)
    want = []
    for f in inv:
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / high:
            want.append(f)
        elif wavelen > 8192 / low:
            want.append(f / 8.0)
        else:
            s = (8192 / wavelen - low) / (high - low)
            want.append((1 - s) * f / 8.0 + s * f)
    got = llama3_scaled(inv.astype(np.float32), 8.0, low, high, 8192)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    medium = [(8192 / high) <= 2 * np.pi / f <= 8192 / low for f in inv]
    assert sum(medium) >= 2  # the three branches are all exercised
    if (low, high) == (1.0, 4.0):
        assert np.array_equal(model_inverse_frequencies(preset("llama31_8b")), got)
    assert np.array_equal(model_inverse_frequencies(preset("qwen3_8b")),
                          inverse_frequencies(128, 1e6))  # fmt: skip


def test_rope_tables_are_float32_as_transformers_computes_them() -> None:
    """transformers computes the inverse frequencies in float32 (an int64 arange cast to float,
    float32 powers and division): the tables are float32 and bitwise that computation, and the
    scaling stays in float32 too (another dtype anywhere changes the bits)."""
    d, base = 64, 500000.0
    want = np.float32(1.0) / (np.float32(base) ** (np.arange(0, d, 2).astype(np.float32)
                                                   / np.float32(d)))  # fmt: skip
    got = inverse_frequencies(d, base)
    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))
    scaled = llama3_scaled(got, 8.0, 1.0, 4.0, 8192)
    assert scaled.dtype == np.float32
    wide = llama3_scaled(got.astype(np.float64), 8.0, 1.0, 4.0, 8192)
    assert np.array_equal(scaled, wide)  # the input is taken as float32 whatever it came as
