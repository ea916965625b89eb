"""Hugging Face ``config.json`` ↔ `ModelArgs`, without Paddle (so `flashcp validate` reads it).

Reading (`parse_hf_config`, `args_from_hf_config`): GLM-4 (``Glm4ForCausalLM``, model_type
``glm4``) and GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``, ``glm4_moe``) configs as written
by transformers 4.x or 5.x, and flashcp's own GPT exports (``FlashcpGPTForCausalLM``, which
carry the exact `ModelArgs` under `ARGS_KEY`). The rule: the model built is the one
transformers builds from the same file, or the file is refused with every reason at once.

* A key the file lacks takes the default of the transformers config class (5.3; e.g. GLM-4
  ``head_dim`` 128 and ``attention_bias`` true, GLM-4.5 ``attention_bias`` false and
  ``first_k_dense_replace`` 1: `HF_DEFAULTS`), never a flashcp default.
* RoPE in both layouts: 4.x top-level ``rope_theta`` / ``rope_scaling`` /
  ``partial_rotary_factor``, 5.x ``rope_parameters: {rope_type, rope_theta,
  partial_rotary_factor}``. Only plain RoPE (``rope_type`` "default") is implemented: any
  other type, any non-null ``rope_scaling``, any other ``rope_parameters`` key (scaling factors,
  per-layer-type dicts) is refused, and so are both layouts giving different values.
* Refused because flashcp would compute another model: ``hidden_act`` other than silu,
  non-zero ``attention_dropout``, ``quantization_config``, group-limited routing
  (``topk_group`` < ``n_group``; ``n_group == topk_group`` selects among all experts, which is
  plain top-k, and is accepted), an architecture / model_type other than the two above.
* ``use_qk_norm`` (GLM-4.5): QK-norm is built (`ModelArgs.use_qk_norm`). GLM-4's
  ``Glm4Attention`` has no QK-norm, so the key is ignored there, as transformers does.
* ``num_nextn_predict_layers`` (GLM-4.5's multi-token-prediction layers, 1 in GLM-4.5 and
  GLM-4.5-Air): `ModelArgs.mtp_layers`, so they are built (on the last pipeline stage) and
  their weights ``model.layers.{num_hidden_layers + d}.*`` loaded and exported
  (`flashcp.models.mtp`); transformers' ``Glm4MoeForCausalLM`` ignores them, the serving
  engines use them for speculative decoding (`NOTE_MTP`). A run may carry fewer of them
  (``model.mtp_layers`` is free, `TRAINING_FIELDS`: 0 skips their weights). GLM-4's
  ``Glm4Config`` has no such key; flashcp reads it there too (its own GLM exports of a model
  with MTP layers write it, see below).
* PaddleFormers (1.2.0) saves GLM-4.5 under its own class names (``architectures:
  ['Glm4MoeForCausalLMDeprecated']``, its eager class, and the pipeline / fleet variants:
  `PADDLEFORMERS_ARCHS`), in the HF layout (its ``_gen_inv_aoa_config`` splits its fused
  ``qkv_proj`` / ``up_gate_proj`` back into the HF tensors; the router ``mlp.gate.weight`` is
  stored in bfloat16 even in a float32 model, which the loader widens exactly), with keys of
  its own. Each is classified (`IGNORED_KEYS`, `CHECKED_KEYS`): a key that steers only that
  library's own training or inference (tensor/pipeline parallelism, kernel fusion, token
  dispatch, its aux-loss style, transformers' ``output_router_logits``) is accepted with a note
  (`NOTE_IGNORED`); a key that changes the maths is accepted at the value flashcp computes
  (``scoring_func`` sigmoid, ``topk_method`` noaux_tc, ``use_fp8`` false, ``sliding_window``
  null) and refused with the reason at any other.
* Every other key must be one flashcp knows (`KNOWN_KEYS`: the model keys above and metadata
  such as ``torch_dtype``, token ids, ``use_cache``): an unknown key might change the model, so
  it is refused with the advice to remove it if it is only metadata.
* `missing_mtp_layers` reads a directory's tensor index (no tensor data) to find declared MTP
  layers without tensors, as transformers' ``save_pretrained`` writes GLM-4.5 (it keeps
  ``num_nextn_predict_layers: 1`` but drops the layer): `flashcp validate` refuses that in one
  line naming ``model.mtp_layers=0``.

Writing (`hf_config`): the same keys back, in BOTH RoPE layouts (top-level keys for
transformers 4.x and PaddleFormers, ``rope_parameters`` for 5.x), with the right
``architectures``; a `ModelArgs` that no HF class computes (e.g. GLM with another rotary
pairing) is refused. ``num_nextn_predict_layers`` is `ModelArgs.mtp_layers`: always written for
GLM-4.5 (as its own configs do), for GLM-4 only when > 0 (``Glm4Config`` keeps an unknown key
as a plain attribute and ``Glm4ForCausalLM`` ignores it and the MTP weights, so transformers
still loads the export; flashcp reads it back); GPT exports carry it in `ARGS_KEY`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from flashcp.models.config import ModelArgs

CONFIG_FILE = "config.json"
ARGS_KEY = "flashcp_model_args"
"""Key of the exact `ModelArgs` in a flashcp GPT export's config.json."""

HF_ARCH = {
    "gpt": ("FlashcpGPTForCausalLM", "flashcp_gpt"),
    "glm": ("Glm4ForCausalLM", "glm4"),
    "glm_moe": ("Glm4MoeForCausalLM", "glm4_moe"),
}
"""flashcp arch → (HF ``architectures`` entry, ``model_type``)."""
ARCH_OF_MODEL_TYPE = {model_type: arch for arch, (_, model_type) in HF_ARCH.items()}
PADDLEFORMERS_ARCHS = {
    name: "glm_moe"
    for name in (
        "Glm4MoeForCausalLMDeprecated",
        "Glm4MoeForCausalLMPipe",
        "Glm4MoeForCausalLMPipeDeprecated",
        "Glm4MoeForCausalLMFleet",
        "Glm4MoeForCausalLMPipeFleet",
    )
}
"""PaddleFormers 1.2.0's GLM-4.5 classes (``paddleformers.transformers.glm4_moe``) → flashcp
arch: each saves through the same inverse conversion (``_gen_inv_aoa_config``) into the HF
tensor layout of ``Glm4MoeForCausalLM`` and writes its own class name into ``architectures``."""
SUPPORTED = (
    "Glm4ForCausalLM (GLM-4-0414, model_type glm4), Glm4MoeForCausalLM (GLM-4.5 / "
    "GLM-4.5-Air, model_type glm4_moe; also as PaddleFormers saves it, e.g. "
    "Glm4MoeForCausalLMDeprecated) and flashcp's own exports (FlashcpGPTForCausalLM)"
)
NOTE_MTP = (
    "num_nextn_predict_layers: the multi-token-prediction layers (model.layers.{L}...) are "
    "built on the last pipeline stage and loaded (transformers' Glm4MoeForCausalLM ignores "
    "them); model.mtp_layers: 0 skips them"
)
MTP_KEY = "num_nextn_predict_layers"
"""config.json key of the number of multi-token-prediction layers (`ModelArgs.mtp_layers`)."""

_COMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4": {
        **_COMMON_DEFAULTS,
        "intermediate_size": 13696,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "rms_norm_eps": 1.5625e-07,
        "attention_bias": True,
    },
    "glm4_moe": {
        **_COMMON_DEFAULTS,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": None,  # hidden_size // num_attention_heads
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_routed_experts": 128,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "use_qk_norm": False,
        "num_nextn_predict_layers": 0,
    },
}
"""Defaults of transformers' (5.3) ``Glm4Config`` / ``Glm4MoeConfig`` for the keys read here."""

FIELD_KEYS: dict[str, str] = {
    "arch": "architectures",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "position": "architectures",
    "rotary_base": "rope_theta",
    "partial_rotary_factor": "partial_rotary_factor",
    "rotary_interleaved": "architectures",
    "qkv_bias": "attention_bias",
    "use_qk_norm": "use_qk_norm",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "num_shared_experts": "n_shared_experts",
    "first_k_dense_replace": "first_k_dense_replace",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "initializer_range": "initializer_range",
    "mtp_layers": MTP_KEY,
}
"""`ModelArgs` field → the config.json key that defines it (for messages)."""
TRAINING_FIELDS = (
    "recompute",
    "residual_dtype",
    "tile_tokens",
    "moe_capacity_factor",
    "router_bias_update_rate",
    "router_aux_loss_coef",
    "mtp_layers",
    "mtp_loss_weight",
)
"""`ModelArgs` fields a run config sets freely over config.json — how the run trains
(recompute, the residual stream's dtype between layers, sequence tiling, MoE token capacity,
the router's load balancing, the MTP loss weight), not which model it is. ``mtp_layers`` is
read from config.json (``num_nextn_predict_layers``) but a run may carry fewer of the
checkpoint's MTP layers (0: their weights are skipped when loading, with a note); more than
the checkpoint holds is refused when loading, naming the missing weights."""

_MODEL_KEYS = {
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_shared_experts",
    "n_routed_experts",
    "num_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "norm_topk_prob",
    "use_qk_norm",
    "num_nextn_predict_layers",
    "quantization_config",
}
_METADATA_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "is_encoder_decoder",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "torchscript",
    "_attn_implementation",
    "use_sliding_window",  # written as false by some GLM exports; true is refused below
    ARGS_KEY,
}
IGNORED_KEYS: dict[str, str] = {
    "paddleformers_version": "PaddleFormers",
    "disable_ffn_model_parallel": "PaddleFormers",  # tensor parallelism of the MoE FFN
    "pp_seg_method": "PaddleFormers",  # how its pipeline cuts the layers
    "fuse_rms_norm": "PaddleFormers",  # a fused RMSNorm kernel, same maths
    "fd_fallback": "PaddleFormers",  # FastDeploy's stacked-experts module, same maths
    "using_flex_token": "PaddleFormers",  # its token dispatcher for expert parallelism
    "moe_subbatch_token_num_before_dispatch": "PaddleFormers",  # rows per dispatch call
    "seq_aux": "PaddleFormers",  # sequence-wise aux loss in its training: a loss, not the model
    "output_router_logits": "transformers",  # return router logits (and their aux loss)
}
"""Keys that steer only a library's own training or inference (its parallelism, kernels,
outputs, auxiliary losses), never the model's function: accepted whatever their value, named in
one note (`NOTE_IGNORED`). flashcp's own router balancing is ``model.router_aux_loss_coef``."""
CHECKED_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "scoring_func": (
        ("sigmoid",),
        "flashcp's GLM-4.5 router scores experts with a sigmoid (as GLM-4.5 and transformers' "
        "Glm4MoeForCausalLM do)",
    ),
    "topk_method": (
        ("noaux_tc",),
        "flashcp's GLM-4.5 router picks the top-k of sigmoid scores plus "
        "e_score_correction_bias (noaux_tc, as GLM-4.5 does)",
    ),
    "use_fp8": ((False, None), "flashcp computes in float32 / bfloat16, not FP8"),
    "sliding_window": (
        (None,),
        "flashcp computes GLM-4.5 with full causal attention in every layer, as GLM-4.5 does",
    ),
}
"""Keys a library writes that change the model's maths: (the values flashcp computes exactly,
why another value is refused)."""
KNOWN_KEYS = frozenset(_MODEL_KEYS | _METADATA_KEYS | set(IGNORED_KEYS) | set(CHECKED_KEYS))
NOTE_IGNORED = (
    "config.json keys {keys} steer only {owners}' own training or inference (parallelism, "
    "kernels, outputs, auxiliary losses), not the model: ignored"
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_ROPE_PARAMETER_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


class HFConfigError(ValueError):
    """A config.json flashcp cannot build exactly; `problems` lists (config key, reason)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
        super().__init__(f"{source} cannot be loaded as it is:\n{lines}")


def read_config_json(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(the mapping, its path as text) of a ``config.json`` file or a directory holding one."""
    p = Path(path)
    file = p / CONFIG_FILE if p.is_dir() else p
    if not file.is_file():
        where = f"{p} has no {CONFIG_FILE}" if p.is_dir() else f"{p} does not exist"
        raise FileNotFoundError(
            f"{where}: point at a Hugging Face model directory (config.json + safetensors)"
        )
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(data).__name__}")
    return data, str(file)


def _same(a: Any, b: Any) -> bool:
    if _number(a) and _number(b):
        return float(a) == float(b)
    return bool(a == b)


def _architecture(config: Mapping[str, Any], problems: list[tuple[str, str]]) -> str | None:
    """flashcp arch of `config`, or None (with the reason in `problems`)."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    names = {**{entry[0]: arch for arch, entry in HF_ARCH.items()}, **PADDLEFORMERS_ARCHS}
    arch_of_list = None
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in names:
            problems.append(
                (
                    "architectures",
                    f"{archs!r} (model_type {model_type!r}) is not supported: flashcp builds "
                    f"{SUPPORTED}",
                )
            )
            return None
        arch_of_list = names[archs[0]]
    arch_of_type = ARCH_OF_MODEL_TYPE.get(str(model_type)) if model_type is not None else None
    if model_type is not None and arch_of_type is None:
        problems.append(
            ("model_type", f"{model_type!r} is not supported: flashcp builds {SUPPORTED}")
        )
        return None
    if arch_of_list and arch_of_type and arch_of_list != arch_of_type:
        problems.append(
            (
                "model_type",
                f"{model_type!r} does not match architectures {archs!r}: fix config.json",
            )
        )
        return None
    arch = arch_of_list or arch_of_type
    if arch is None:
        problems.append(
            (
                "architectures",
                f"config.json names neither architectures nor model_type: "
                f"flashcp builds {SUPPORTED}",
            )  # fmt: skip
        )
    return arch


def read_rope(
    config: Mapping[str, Any], defaults: Mapping[str, Any], problems: list[tuple[str, str]]
) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from either RoPE layout; unimplemented variants and
    contradictions between the layouts go to `problems`."""
    scaling = config.get("rope_scaling")
    if scaling not in (None, {}):
        problems.append(
            (
                "rope_scaling",
                f"{scaling!r}: scaled RoPE is not implemented (flashcp computes plain RoPE): "
                "use a checkpoint without rope_scaling",
            )
        )
    params = config.get("rope_parameters")
    nested: Mapping[str, Any] = {}
    if params is not None:
        if not isinstance(params, Mapping):
            problems.append(("rope_parameters", f"{params!r} must be an object"))
        elif any(isinstance(v, Mapping) for v in params.values()):
            problems.append(
                (
                    "rope_parameters",
                    "per-layer-type RoPE parameters are not implemented (GLM-4 / GLM-4.5 have "
                    f"one RoPE): {sorted(params)}",
                )
            )
        else:
            nested = params
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in ("default", None):
                problems.append(
                    (
                        "rope_parameters.rope_type",
                        f"{rope_type!r} is not implemented: flashcp computes plain RoPE "
                        "(rope_type 'default')",
                    )
                )
            extra = sorted(set(params) - _ROPE_PARAMETER_KEYS)
            if extra:
                problems.append(
                    (
                        "rope_parameters",
                        f"keys {extra} are not implemented (plain RoPE takes rope_type, "
                        "rope_theta and partial_rotary_factor)",
                    )
                )
    values = []
    for key in ("rope_theta", "partial_rotary_factor"):
        top, inner = config.get(key), nested.get(key)
        if top is not None and inner is not None and not _same(top, inner):
            problems.append(
                (
                    f"rope_parameters.{key}",
                    f"{inner!r} contradicts the top-level {key} {top!r}: fix config.json",
                )
            )
        value = inner if inner is not None else top
        values.append(defaults[key] if value is None else value)
    theta, partial = values
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append((key, f"{value!r} must be a number"))
    return float(theta) if _number(theta) else 0.0, float(partial) if _number(partial) else 0.0


def _same_value(a: Any, b: Any) -> bool:
    """`a == b` without True == 1 (a boolean key given 1 is not the value flashcp computes)."""
    return type(a) is type(b) and a == b or a is b


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _get(config: Mapping[str, Any], defaults: Mapping[str, Any], key: str) -> Any:
    value = config.get(key)
    return defaults[key] if value is None and key in defaults else value


def parse_hf_config(
    config: Mapping[str, Any], source: str = CONFIG_FILE
) -> tuple[dict[str, Any], list[str]]:
    """(`ModelArgs` field values, notes) for an HF ``config.json`` mapping (see the module
    docstring); `HFConfigError` listing every reason it cannot be built exactly."""
    problems: list[tuple[str, str]] = []
    arch = _architecture(config, problems)
    if arch is None:
        raise HFConfigError(source, problems)
    if arch == "gpt":
        if not isinstance(config.get(ARGS_KEY), Mapping):
            raise HFConfigError(
                source, [(ARGS_KEY, "a FlashcpGPTForCausalLM config needs its flashcp_model_args")]
            )
        names = {f.name for f in fields(ModelArgs)}
        return {k: v for k, v in config[ARGS_KEY].items() if k in names}, []
    model_type = HF_ARCH[arch][1]
    defaults = HF_DEFAULTS[model_type]
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        problems.append(
            (
                "config.json",
                f"keys flashcp does not know: {unknown}. They may change the model; if they "
                "are only metadata, remove them from config.json",
            )
        )
    if config.get("quantization_config") is not None:
        problems.append(
            (
                "quantization_config",
                "quantized checkpoints are not supported: use the bf16/fp32 weights",
            )  # fmt: skip
        )
    if config.get("hidden_act", "silu") != "silu":
        problems.append(
            ("hidden_act", f"{config['hidden_act']!r}: GLM MLPs here are SwiGLU (silu)")
        )
    dropout = config.get("attention_dropout", 0.0)
    if not _number(dropout) or dropout != 0:
        problems.append(
            (
                "attention_dropout",
                f"{dropout!r}: attention dropout is not implemented; set it to 0.0 in "
                "config.json to train without it",
            )
        )
    if config.get("use_sliding_window"):
        problems.append(("use_sliding_window", "sliding-window attention is not implemented"))
    for key, (allowed, why) in CHECKED_KEYS.items():
        if key in config and not any(_same_value(config[key], a) for a in allowed):
            shown = " or ".join(repr(a) for a in allowed)
            problems.append(
                (key, f"{config[key]!r} is not implemented ({why}): use a checkpoint with {shown}")
            )
    theta, partial = read_rope(config, defaults, problems)
    notes: list[str] = []
    if ignored := sorted(set(config) & set(IGNORED_KEYS)):
        owners = " / ".join(sorted({IGNORED_KEYS[k] for k in ignored}))
        notes.append(NOTE_IGNORED.format(keys=", ".join(ignored), owners=owners))
    values: dict[str, Any] = dict(
        arch=arch,
        vocab_size=_get(config, defaults, "vocab_size"),
        hidden_size=_get(config, defaults, "hidden_size"),
        num_layers=_get(config, defaults, "num_hidden_layers"),
        num_heads=_get(config, defaults, "num_attention_heads"),
        num_kv_heads=_get(config, defaults, "num_key_value_heads"),
        head_dim=_get(config, defaults, "head_dim"),
        intermediate_size=_get(config, defaults, "intermediate_size"),
        max_seq_len=_get(config, defaults, "max_position_embeddings"),
        rotary_base=theta,
        partial_rotary_factor=partial,
        qkv_bias=_get(config, defaults, "attention_bias"),
        tie_embeddings=_get(config, defaults, "tie_word_embeddings"),
        norm_eps=_get(config, defaults, "rms_norm_eps"),
        initializer_range=_get(config, defaults, "initializer_range"),
    )
    if arch == "glm_moe":
        n_group = _get(config, defaults, "n_group")
        topk_group = _get(config, defaults, "topk_group")
        if n_group != 1 and topk_group != n_group:
            problems.append(
                (
                    "topk_group",
                    f"group-limited expert routing (n_group {n_group}, topk_group "
                    f"{topk_group}) is not implemented: flashcp routes top-k over all experts",
                )
            )
        experts = config.get("n_routed_experts", config.get("num_experts"))
        values.update(
            num_experts=defaults["n_routed_experts"] if experts is None else experts,
            num_experts_per_tok=_get(config, defaults, "num_experts_per_tok"),
            moe_intermediate_size=_get(config, defaults, "moe_intermediate_size"),
            num_shared_experts=_get(config, defaults, "n_shared_experts"),
            first_k_dense_replace=_get(config, defaults, "first_k_dense_replace"),
            routed_scaling_factor=_get(config, defaults, "routed_scaling_factor"),
            norm_topk_prob=_get(config, defaults, "norm_topk_prob"),
            use_qk_norm=_get(config, defaults, "use_qk_norm"),
        )
    mtp = config.get(MTP_KEY)
    mtp = 0 if mtp is None else mtp  # Glm4Config has no such key; Glm4MoeConfig's default
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        problems.append((MTP_KEY, f"{mtp!r} must be an integer >= 0 (the number of MTP layers)"))
    else:
        values["mtp_layers"] = mtp
        if mtp:
            notes.append(NOTE_MTP)
    for key in ("rotary_base", "partial_rotary_factor", "norm_eps", "initializer_range"):
        if _number(values[key]):
            values[key] = float(values[key])
    if arch == "glm_moe" and _number(values["routed_scaling_factor"]):
        values["routed_scaling_factor"] = float(values["routed_scaling_factor"])
    for key, value in values.items():
        if key != "arch" and not isinstance(value, (int, float, bool, type(None))):
            problems.append((FIELD_KEYS.get(key, key), f"{value!r} must be a number or boolean"))
    if problems:
        raise HFConfigError(source, problems)
    return values, notes


def directory_notes(directory: str | os.PathLike[str]) -> list[str]:
    """The notes `parse_hf_config` gives for a model directory's config.json (keys accepted
    but ignored, MTP layers kept), each naming the directory; empty when it does not parse
    (its refusal is reported where the config is validated)."""
    try:
        config, source = read_config_json(directory)
        _, notes = parse_hf_config(config, source)
    except (OSError, ValueError):
        return []
    return [f"{directory}: {note}" for note in notes]


def args_from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
) -> ModelArgs:
    """`ModelArgs` from a `config.json` (path, directory or mapping): GLM-4 / GLM-4.5 by their
    HF keys, flashcp GPT exports exactly; `HFConfigError` when that model cannot be built."""
    source = CONFIG_FILE
    if not isinstance(config, Mapping):
        config, source = read_config_json(config)
    values, _ = parse_hf_config(config, source)
    return ModelArgs(**{**values, **overrides}).check()


def checkpoint_keys(directory: str | os.PathLike[str]) -> list[str]:
    """The tensor names of a model directory's safetensors weights, from its index
    (``model.safetensors.index.json``) or the header of ``model.safetensors`` — no tensor data
    is read. `FileNotFoundError` / `ValueError` when neither is there or readable."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object: re-download it")
        return sorted(weight_map)
    single = d / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{d} has no model.safetensors or model.safetensors.index.json")
    with single.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{single} has no safetensors header: re-download it")
    return sorted(k for k in header if k != "__metadata__")


def missing_mtp_layers(keys: list[str], num_layers: int, mtp_layers: int) -> list[int]:
    """The MTP layers ``model.layers.{num_layers + d}`` (d < `mtp_layers`) of which `keys` (a
    checkpoint's tensor names) hold no tensor at all."""
    prefixes = [f"model.layers.{num_layers + d}." for d in range(mtp_layers)]
    return [
        num_layers + d
        for d, prefix in enumerate(prefixes)
        if not any(k.startswith(prefix) for k in keys)
    ]


def mtp_refusal(
    directory: str | os.PathLike[str], num_layers: int, declared: int, asked: int
) -> str | None:
    """One line refusing a run that asks for `asked` MTP layers (``model.mtp_layers``; config.json
    ``num_nextn_predict_layers`` `declared` by default) the directory's weights do not hold —
    transformers' ``save_pretrained`` writes GLM-4.5 so: the key kept, the layer dropped — with
    the fix; None when they are there (or none is asked). A partly present layer is left to the
    loader, which names each missing tensor."""
    if asked <= 0:
        return None
    missing = missing_mtp_layers(checkpoint_keys(directory), num_layers, asked)
    if not missing:
        return None
    layers = ", ".join(f"model.layers.{i}.*" for i in missing)
    some = "s" if len(missing) > 1 else ""
    why = (
        f"{directory}/config.json declares {MTP_KEY}: {declared}"
        if asked == declared
        else f"model.mtp_layers is {asked}"
    )
    return (
        f"{why}, but the weights in {directory} hold no tensor of the multi-token-prediction "
        f"layer{some} {layers} (transformers' save_pretrained leaves them out): set "
        f"model.mtp_layers={missing[0] - num_layers} to train without "
        f"{'them' if some else 'it'}"
    )


def exportable(args: ModelArgs) -> list[str]:
    """Why `args` is not what its HF class computes (empty when an HF export is exact)."""
    problems = []
    if args.arch in ("glm", "glm_moe") and args.interleaved_rotary != (args.arch == "glm"):
        problems.append(
            f"model.rotary_interleaved {args.rotary_interleaved}: {HF_ARCH[args.arch][0]} "
            f"rotates {'interleaved' if args.arch == 'glm' else 'half-split'} pairs"
        )
    return problems


def hf_config(
    args: ModelArgs,
    dtype: str = "float32",
    *,
    token_ids: Mapping[str, Any] | None = None,
    nulls: bool = False,
) -> dict[str, Any]:
    """The HF ``config.json`` of `args` (both RoPE layouts; GPT also gets `ARGS_KEY`).

    `token_ids`: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` to record (e.g. those
    of the config.json the run started from); a None value is left out, or with `nulls`
    written as an explicit null (transformers then does not fill in its class default).
    `ValueError` when no HF class computes `args`.
    """
    problems = exportable(args)
    if problems:
        raise ValueError("this model has no exact Hugging Face config: " + "; ".join(problems))
    architecture, model_type = HF_ARCH[args.arch]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rotary_base,
        "partial_rotary_factor": args.partial_rotary_factor,
        "attention_bias": args.qkv_bias,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.initializer_range,
        "torch_dtype": dtype,
    }
    if args.arch == "gpt":
        cfg.update(layer_norm_eps=args.norm_eps, hidden_act="gelu", position=args.position)
        cfg[ARGS_KEY] = args.to_dict()
    else:
        cfg.update(
            rms_norm_eps=args.norm_eps,
            hidden_act="silu",
            attention_dropout=0.0,
            rope_scaling=None,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": args.rotary_base,
                "partial_rotary_factor": args.partial_rotary_factor,
            },
            use_cache=True,
        )
    if args.arch == "glm_moe":
        cfg.update(
            n_routed_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            n_shared_experts=args.num_shared_experts,
            first_k_dense_replace=args.first_k_dense_replace,
            routed_scaling_factor=args.routed_scaling_factor,
            norm_topk_prob=args.norm_topk_prob,
            n_group=1,
            topk_group=1,
            use_qk_norm=args.use_qk_norm,
        )
    if args.arch == "glm_moe" or args.arch == "glm" and args.mtp_layers:
        cfg[MTP_KEY] = args.mtp_layers
    for key in TOKEN_ID_KEYS:
        if token_ids is not None and (token_ids.get(key) is not None or nulls and key in token_ids):
            cfg[key] = token_ids[key]
    return cfg
