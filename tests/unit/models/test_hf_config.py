"""HF config.json → ModelArgs: both RoPE layouts (transformers 4.x top-level keys, 5.x
`rope_parameters`), the transformers class defaults for absent keys, and every refusal
(unimplemented RoPE variants, contradictions, unknown architectures and keys)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from flashcp.models import ModelArgs, preset
from flashcp.models.hf_config import (
    HFConfigError,
    args_from_hf_config,
    hf_config,
    parse_hf_config,
    read_config_json,
)
from flashcp.models.hf_mtp import NOTE_MTP

MOE_5X: dict[str, Any] = {  # what transformers 5.3 writes for a tiny Glm4MoeForCausalLM
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "dtype": "float32",
    "first_k_dense_replace": 1,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 16,
    "n_group": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 5e4, "rope_type": "default"},
    "routed_scaling_factor": 1.7,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "transformers_version": "5.3.0",
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 300,
}


def as_4x(config: dict[str, Any]) -> dict[str, Any]:
    """The same model in transformers 4.x's layout: RoPE keys at the top level."""
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    rope = config["rope_parameters"]
    out.update(rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype="float32")
    out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return out


def _problems(config: dict[str, Any]) -> str:
    with pytest.raises(HFConfigError) as info:
        parse_hf_config(config, "DIR/config.json")
    assert "DIR/config.json" in str(info.value)
    return str(info.value)


def test_both_rope_layouts_give_the_same_model_with_the_files_theta() -> None:
    new = args_from_hf_config(MOE_5X)
    old = args_from_hf_config(as_4x(MOE_5X))
    assert new == old
    assert new.rotary_base == 50000.0  # the bug: 5.x kept it in rope_parameters → 10000
    assert new.use_qk_norm and new.qkv_bias and new.routed_scaling_factor == 1.7
    assert new.arch == "glm_moe" and new.num_experts == 4 and new.head_size == 8


def test_rope_parameters_alone_without_top_level_keys() -> None:
    config = {k: v for k, v in MOE_5X.items() if k != "partial_rotary_factor"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    args = args_from_hf_config(config)
    assert args.rotary_base == 123.0 and args.partial_rotary_factor == 0.5  # HF default


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type: 'linear' is not implemented",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
            "keys ['factor'] belong to rope_type 'llama3', not 'default'",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_theta": 1e4}}},
            "per-layer-type RoPE parameters are not implemented",
        ),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "'yarn' is not implemented"),
        (
            {"rope_theta": 10000.0},
            "rope_parameters.rope_theta: 50000.0 contradicts the top-level rope_theta 10000.0",
        ),
        (
            {"partial_rotary_factor": 1.0},
            "rope_parameters.partial_rotary_factor: 0.5 contradicts the top-level",
        ),
        ({"rope_theta": "5e4"}, "contradicts the top-level rope_theta '5e4'"),
        ({"rope_parameters": [1]}, "rope_parameters: [1] must be an object"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
        ({"attention_dropout": 0.1}, "attention_dropout: 0.1: attention dropout is not"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints"),
        ({"n_group": 4, "topk_group": 2}, "group-limited expert routing (n_group 4, topk_group 2)"),
        (
            {"layer_types": ["full_attention"]},
            "keys flashcp does not know for Glm4MoeForCausalLM: ['layer_types']",
        ),
        ({"sliding_window": 128}, "sliding_window: 128 is not implemented (flashcp computes"),
        ({"scoring_func": "softmax"}, "scoring_func: 'softmax' is not implemented (flashcp's"),
        ({"topk_method": "greedy"}, "topk_method: 'greedy' is not implemented"),
        ({"use_fp8": True}, "use_fp8: True is not implemented (flashcp computes in float32"),
        ({"use_fp8": 1}, "use_fp8: 1 is not implemented"),
        ({"use_sliding_window": True}, "sliding-window attention is not implemented"),
        (
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
            "architectures: ['MistralForCausalLM'] (model_type 'mistral') is not supported: "
            "flashcp builds FlashcpGPTForCausalLM (flashcp_gpt), Glm4ForCausalLM (glm4)",
        ),
        ({"model_type": "glm4"}, "does not match architectures"),
        ({"architectures": None, "model_type": None}, "names neither architectures nor"),
        ({"vocab_size": "big"}, "vocab_size: 'big' must be a number"),
        ({"rope_parameters": {"rope_theta": "x"}}, "rope_theta: 'x' must be a number"),
    ],
)
def test_refusals_name_the_key_and_why(change: dict[str, Any], expected: str) -> None:
    assert expected in _problems({**MOE_5X, **change})


def test_every_problem_is_listed_at_once() -> None:
    text = _problems({**MOE_5X, "hidden_act": "relu", "rope_scaling": {"type": "linear"}})
    assert "hidden_act" in text and "rope_scaling" in text


def test_whole_expert_groups_are_plain_top_k() -> None:
    assert args_from_hf_config({**MOE_5X, "n_group": 2, "topk_group": 2}).num_experts == 4


def test_absent_keys_take_the_transformers_class_defaults() -> None:
    glm4 = {
        "architectures": ["Glm4ForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
    }
    args = args_from_hf_config(glm4)
    assert args.head_dim == 128 and args.qkv_bias and args.norm_eps == 1.5625e-07
    assert args.partial_rotary_factor == 0.5 and args.rotary_base == 10000.0
    assert args.max_seq_len == 131072 and not args.tie_embeddings
    moe = {k: v for k, v in MOE_5X.items() if k not in ("attention_bias", "first_k_dense_replace",
                                                          "head_dim", "use_qk_norm")}  # fmt: skip
    args = args_from_hf_config(moe)
    assert not args.qkv_bias and args.first_k_dense_replace == 1 and not args.use_qk_norm
    assert args.head_dim == args.head_size == 32 // 4  # hidden_size // num_attention_heads


def test_glm4_ignores_use_qk_norm_as_transformers_does() -> None:
    config = {**MOE_5X, "architectures": ["Glm4ForCausalLM"], "model_type": "glm4"}
    for key in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts", "topk_group",
                "n_group", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "routed_scaling_factor"):  # fmt: skip
        config.pop(key)
    args = args_from_hf_config(config)
    assert args.arch == "glm" and not args.use_qk_norm and args.interleaved_rotary


@pytest.mark.parametrize("layout", [dict, as_4x], ids=["5.x", "4.x"])
def test_mtp_layers_are_read_into_mtp_layers(layout: Any) -> None:
    """GLM-4.5's ``num_nextn_predict_layers`` is `ModelArgs.mtp_layers` (both config layouts),
    noted; absent it is 0 (the class default), as for GLM-4, whose class has no such key."""
    values, notes = parse_hf_config(layout({**MOE_5X, "num_nextn_predict_layers": 1}))
    assert notes == [NOTE_MTP] and values["mtp_layers"] == 1 and values["num_layers"] == 2
    assert args_from_hf_config(layout({**MOE_5X, "num_nextn_predict_layers": 1})).mtp_layers == 1
    values, notes = parse_hf_config(layout(MOE_5X))
    assert notes == [] and values["mtp_layers"] == 0
    glm4 = {**layout(MOE_5X), "architectures": ["Glm4ForCausalLM"], "model_type": "glm4"}
    for key in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts", "topk_group",
                "n_group", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "routed_scaling_factor"):  # fmt: skip
        glm4.pop(key)
    assert args_from_hf_config(glm4).mtp_layers == 0
    assert args_from_hf_config({**glm4, "num_nextn_predict_layers": 2}).mtp_layers == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_mtp_layer_counts_are_refused_naming_the_key(bad: Any) -> None:
    text = _problems({**MOE_5X, "num_nextn_predict_layers": bad})
    assert f"num_nextn_predict_layers: {bad!r} must be an integer >= 0" in text


@pytest.mark.parametrize("arch", ["gpt", "glm", "glm_moe"])
@pytest.mark.parametrize("mtp", [0, 1])
def test_exported_mtp_layers_round_trip(arch: str, mtp: int) -> None:
    """An export writes ``num_nextn_predict_layers``: always for GLM-4.5 (as its own configs
    do), for GLM-4 only when there are MTP layers (transformers' Glm4Config keeps it as an
    extra attribute), GPT inside its flashcp args; each reads back the same model."""
    name = "tiny" if arch == "gpt" else f"tiny_{arch}"
    args = preset(name, mtp_layers=mtp, mtp_loss_weight=0.5 if mtp else 0.0)
    config = hf_config(args)
    back = args_from_hf_config(config)
    assert back.mtp_layers == mtp
    if arch == "glm_moe" or arch == "glm" and mtp:
        assert config["num_nextn_predict_layers"] == mtp
    else:
        assert "num_nextn_predict_layers" not in config
    if arch != "gpt":  # the loss weight is how a run trains, not the model: not in config.json
        assert back == dataclasses.replace(args, head_dim=args.head_size, mtp_loss_weight=0.0)


@pytest.mark.parametrize("arch", ["glm", "glm_moe"])
def test_hf_config_round_trips(arch: str) -> None:
    extra = {"use_qk_norm": True} if arch == "glm_moe" else {}
    args = preset(f"tiny_{arch}", rotary_base=2500.0, tie_embeddings=True, **extra)
    config = hf_config(args, "bfloat16", token_ids={"eos_token_id": [5, 6], "pad_token_id": None})
    assert args_from_hf_config(config) == dataclasses.replace(args, head_dim=args.head_size)
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 2500.0
    assert config["eos_token_id"] == [5, 6] and "pad_token_id" not in config
    assert config["torch_dtype"] == "bfloat16"


def test_gpt_export_round_trips_through_its_flashcp_args() -> None:
    args = preset("tiny", position="learned")
    config = hf_config(args)
    assert config["architectures"] == ["FlashcpGPTForCausalLM"]
    assert args_from_hf_config(config) == args
    with pytest.raises(HFConfigError, match="needs its flashcp_model_args"):
        parse_hf_config({"architectures": ["FlashcpGPTForCausalLM"]})


def test_models_hf_cannot_compute_are_not_exported() -> None:
    with pytest.raises(ValueError, match="rotary_interleaved False: Glm4ForCausalLM rotates"):
        hf_config(preset("tiny_glm", rotary_interleaved=False))


def test_qk_norm_is_glm45_only() -> None:
    errs = {e.key: e.problem for e in ModelArgs(arch="glm", use_qk_norm=True).problems()}
    assert "always computes use_qk_norm=False" in errs["model.use_qk_norm"]


def test_read_config_json_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_config_json(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_config_json(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(MOE_5X))
    assert args_from_hf_config(tmp_path).rotary_base == 50000.0


def test_keys_steering_only_a_librarys_own_outputs_are_noted_not_refused() -> None:
    """transformers 5.24's ``output_router_logits`` (issue 27, defect 9) only changes what its
    forward returns: accepted, named in one note; the model is the one without it."""
    values, notes = parse_hf_config({**MOE_5X, "output_router_logits": False})
    assert values == parse_hf_config(MOE_5X)[0]
    assert notes == [
        "config.json keys output_router_logits steer only transformers' own training or "
        "inference (parallelism, kernels, outputs, auxiliary losses), not the model: ignored"
    ]
    assert parse_hf_config(MOE_5X)[1] == []  # negative control: nothing to note without it


def test_mtp_problems_read_an_index_or_a_single_files_header(tmp_path: Path) -> None:
    """The MTP check reads tensor names only: from the index, or from ``model.safetensors``'s
    header; unreadable ones are errors naming the file."""
    import numpy as np
    from safetensors.numpy import save_file

    from flashcp.models.hf_mtp import mtp_problems
    from flashcp.models.weight_files import checkpoint_keys

    one = np.zeros(2, np.float32)
    save_file({"model.layers.2.eh_proj.weight": one, "model.norm.weight": one},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    assert checkpoint_keys(tmp_path) == ["model.layers.2.eh_proj.weight", "model.norm.weight"]
    assert mtp_problems(tmp_path, 2, declared=1, asked=1) == []
    assert mtp_problems(tmp_path, 2, declared=2, asked=0) == []
    (two,) = mtp_problems(tmp_path, 2, declared=2, asked=2)
    assert two.key == "model.mtp_layers" and "num_nextn_predict_layers: 2" in two.message
    assert "layer model.layers.3.* (" in two.message
    assert two.fixes == ((("model.mtp_layers", 1),),)
    assert two.message.endswith("leaves them out): set model.mtp_layers=1")
    (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"not json")
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file"):
        checkpoint_keys(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="index.json has no 'weight_map' object"):
        checkpoint_keys(tmp_path)
    with pytest.raises(FileNotFoundError, match="nothing does not exist"):
        checkpoint_keys(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors or model.safetensors"):
        checkpoint_keys(tmp_path / "empty")


# -- booleans given as 0 / 1 (issue 39, item 12) ------------------------------------------------


@pytest.mark.parametrize("key", ["use_fp8", "use_sliding_window"])
@pytest.mark.parametrize("value", [1, 0, True, False])
def test_a_checked_boolean_given_as_0_or_1_is_never_misread(key: str, value: Any) -> None:
    """A boolean key flashcp checks because flashcp never computes it on (FP8, sliding-window
    attention): 1 — on, as transformers' truthiness reads it — is refused naming the key;
    0 is off (accepted) or refused naming the key, never read as on."""
    config = {**MOE_5X, key: value}
    if value:
        assert f"  {key}: " in _problems(config)
        return
    try:
        parse_hf_config(config, "DIR/config.json")
    except HFConfigError as exc:
        assert [k for k, _ in exc.problems] == [key], exc.problems


BOOL_FIELDS = {  # config.json key → the ModelArgs field it defines
    "attention_bias": "qkv_bias",
    "tie_word_embeddings": "tie_embeddings",
    "use_qk_norm": "use_qk_norm",
    "norm_topk_prob": "norm_topk_prob",
}


@pytest.mark.parametrize("value", [0, 1])
@pytest.mark.parametrize("key", sorted(BOOL_FIELDS))
def test_a_model_boolean_given_as_0_or_1_is_read_as_transformers_reads_it(
    key: str, value: int
) -> None:
    """transformers builds from `attention_bias: 1` what it builds from `true` (its modules
    test the value's truth): flashcp reads the same boolean, or refuses the key."""
    try:
        args = args_from_hf_config({**MOE_5X, key: value})
    except HFConfigError as exc:
        assert [k for k, _ in exc.problems] == [key], exc.problems
        return
    got = getattr(args, BOOL_FIELDS[key])
    assert type(got) is bool and got is bool(value), (key, value, got)


def test_a_run_from_a_directory_with_0_or_1_booleans_reloads_its_config(tmp_path: Path) -> None:
    """A run's config.yaml (what resume, `flashcp eval RUN_DIR` and export read) from a
    `model.from_pretrained` directory whose config.json writes booleans as 0 / 1 reloads to
    the same model."""
    import yaml

    from flashcp.config import build_config, to_yaml
    from flashcp.models import build_model
    from flashcp.models.hf_save import save_hf_checkpoint

    directory = tmp_path / "model"
    save_hf_checkpoint(build_model(args_from_hf_config(MOE_5X), seed=0), directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(attention_bias=1, tie_word_embeddings=0, use_qk_norm=1, norm_topk_prob=1)
    (directory / "config.json").write_text(json.dumps(config))
    raw = {"model": {"from_pretrained": str(directory)},
           "data": {"tokenizer": "byte", "seq_len": 64}}  # fmt: skip
    cfg = build_config(raw)
    assert cfg.model.qkv_bias and not cfg.model.tie_embeddings and cfg.model.use_qk_norm
    again = build_config(yaml.safe_load(to_yaml(cfg)))
    assert again.model == cfg.model


def test_a_run_without_the_mtp_layers_is_told_they_are_skipped(tmp_path: Path) -> None:
    """`model.mtp_layers=0` over a directory declaring them: the note says they are skipped,
    never that they 'are built on the last pipeline stage and loaded' (issue 37)."""
    from flashcp.models.hf_config import directory_notes
    from flashcp.models.hf_mtp import NOTE_MTP_SKIPPED

    (tmp_path / "config.json").write_text(json.dumps({**MOE_5X, "num_nextn_predict_layers": 1}))
    kept, skipped = directory_notes(tmp_path), directory_notes(tmp_path, mtp_layers=0)
    assert any(NOTE_MTP in n for n in kept) and not any(NOTE_MTP_SKIPPED in n for n in kept)
    assert any(NOTE_MTP_SKIPPED in n for n in skipped)
    assert not any("built on the last pipeline stage" in n for n in skipped)
    assert directory_notes(tmp_path, mtp_layers=1) == kept
