"""Hugging Face ``config.json`` ↔ `ModelArgs`, without Paddle (so `flashcp validate` reads it),
for every registered model family (`flashcp.models.families`).

Reading (`parse_hf_config`, `args_from_hf_config`): the family is the one whose
``architectures`` entry (or an alias, e.g. PaddleFormers' class names) and ``model_type`` the
file names; the rule: the model built is the one transformers builds from the same file, or the
file is refused with every reason at once.

* A key the file lacks takes the default of the transformers config class (5.3, the family's
  `HFSide.defaults`), never a flashcp default.
* The keys every decoder shares (`flashcp.models.families.hf.COMMON_FIELDS`) are read here, the
  family's own by its `HFSide.read`.
* RoPE in both layouts (4.x top-level keys, 5.x ``rope_parameters``): `flashcp.models.hf_rope`,
  which refuses what flashcp's RoPE does not compute and the two layouts disagreeing.
* Refused because flashcp would compute another model: a ``hidden_act`` other than the
  family's, non-zero ``attention_dropout``, ``quantization_config``, ``use_sliding_window``
  true, a value the family's class fixes otherwise, an architecture / model_type no family has.
* ``num_nextn_predict_layers`` (GLM-4.5's multi-token-prediction layers) of families that build
  them (`Family.mtp`): `ModelArgs.mtp_layers`, so they are built (on the last pipeline stage)
  and their weights ``model.layers.{num_hidden_layers + d}.*`` loaded and exported
  (`flashcp.models.mtp`); transformers' ``Glm4MoeForCausalLM`` ignores them
  (`hf_mtp.NOTE_MTP`). A run may carry fewer of them (``model.mtp_layers`` is free,
  `TRAINING_FIELDS`: 0 skips them).
* Keys a library writes: those that steer only its own training or inference are accepted
  with a note (`NOTE_IGNORED`: `IGNORED_KEYS` and the family's `HFSide.ignored`); those that
  change the maths are accepted at the value flashcp computes and refused with the reason at
  any other (`CHECKED_KEYS`, `HFSide.checked`).
* Every other key must be one flashcp knows (the family's keys and metadata such as
  ``torch_dtype``, token ids, ``use_cache``): an unknown key might change the model, so it is
  refused with the advice to remove it if it is only metadata.
* Declared MTP layers without tensors (transformers' ``save_pretrained`` writes GLM-4.5 so: it
  keeps ``num_nextn_predict_layers: 1`` but drops the layer) are refused by
  `flashcp.models.hf_mtp.mtp_problems`, from the directory's tensor index alone.

Writing (`hf_config`): the common keys and the family's (`HFSide.write`), RoPE in BOTH layouts
(`hf_rope.rope_config`: top-level keys for transformers 4.x and PaddleFormers,
``rope_parameters`` for 5.x), with the family's ``architectures``; a `ModelArgs` that the
family's class does not compute (e.g. GLM with another rotary pairing) is refused
(`exportable`). flashcp's GPT, which no transformers class computes, carries its exact
`ModelArgs` under `ARGS_KEY`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families import FAMILIES
from flashcp.models.families.gpt import ARGS_KEY
from flashcp.models.families.hf import COMMON_FIELDS, COMMON_KEYS, HFSide, Reader, is_number
from flashcp.models.families.spec import Family
from flashcp.models.hf_mtp import MTP_KEY, NOTE_MTP, NOTE_MTP_SKIPPED
from flashcp.models.hf_rope import ROPE_FIELDS, read_rope, rope_config

CONFIG_FILE = "config.json"
__all__ = ["ARGS_KEY", "CONFIG_FILE", "HFConfigError", "args_from_hf_config", "hf_config"]

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
    "auto_map",  # the remote-code classes of a release (ERNIE-4.5's first upload)
    "use_sliding_window",  # written as false by some exports; true is refused below
}
IGNORED_KEYS: dict[str, str] = {
    "output_router_logits": "transformers",  # return router logits (and their aux loss)
    "router_aux_loss_coef": "transformers",  # its aux loss weight: model.router_aux_loss_coef
}
"""Keys that steer only a library's own training or inference (its parallelism, kernels,
outputs, auxiliary losses), never the model's function, in every family: accepted whatever their
value, named in one note (`NOTE_IGNORED`); a family adds its own (`HFSide.ignored`, e.g.
PaddleFormers' keys). flashcp's own router balancing is ``model.router_aux_loss_coef``."""
CHECKED_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_fp8": ((False, None), "flashcp computes in float32 / bfloat16, not FP8"),
}
"""Keys a library writes that change the maths, in every family: (the values flashcp computes
exactly, why another value is refused); a family adds its own (`HFSide.checked`)."""
NOTE_IGNORED = (
    "config.json keys {keys} steer only {owners}' own training or inference (parallelism, "
    "kernels, outputs, auxiliary losses), not the model: ignored"
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def supported() -> str:
    """The Hugging Face classes flashcp reads, for messages."""
    return ", ".join(
        f"{f.hf.architecture} ({f.hf.model_type})" for f in FAMILIES.values() if f.hf is not None
    )


def field_keys(arch: str | None = None) -> dict[str, str]:
    """`ModelArgs` field → the config.json key that defines it (for messages), for the family
    of `arch` (None: every family's)."""
    keys: dict[str, str] = {"arch": "architectures", "position": "architectures",
                            "rotary_interleaved": "architectures", "mtp_layers": MTP_KEY,
                            **ROPE_FIELDS}  # fmt: skip
    for fam in FAMILIES.values():
        if fam.hf is not None and (arch is None or fam.arch == arch):
            keys.update(fam.hf.all_fields)
    return keys


FIELD_KEYS = field_keys()
"""`ModelArgs` field → a config.json key that defines it (every family's names)."""


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


def _same_value(a: Any, b: Any) -> bool:
    """`a == b` without True == 1 (a boolean key given 1 is not the value flashcp computes)."""
    return type(a) is type(b) and a == b or a is b


def _positive(*xs: Any) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in xs)


def family_of_config(config: Mapping[str, Any], problems: list[tuple[str, str]]) -> Family | None:
    """The family `config` names (``architectures`` and ``model_type``), or None with the
    reason in `problems`."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    names: dict[str, Family] = {}
    types: dict[str, Family] = {}
    for fam in FAMILIES.values():
        if fam.hf is not None:
            names[fam.hf.architecture] = fam
            names.update({alias: fam for alias in fam.hf.aliases})
            types[fam.hf.model_type] = fam
    by_list = None
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in names:
            problems.append(
                (
                    "architectures",
                    f"{archs!r} (model_type {model_type!r}) is not supported: flashcp builds "
                    f"{supported()}",
                )
            )
            return None
        by_list = names[archs[0]]
    by_type = types.get(str(model_type)) if model_type is not None else None
    if model_type is not None and by_type is None:
        problems.append(
            ("model_type", f"{model_type!r} is not supported: flashcp builds {supported()}")
        )
        return None
    if by_list and by_type and by_list is not by_type:
        problems.append(
            ("model_type",
             f"{model_type!r} does not match architectures {archs!r}: fix config.json")  # fmt: skip
        )
        return None
    fam = by_list or by_type
    if fam is None:
        problems.append(
            (
                "architectures",
                f"config.json names neither architectures nor model_type: flashcp builds "
                f"{supported()}",
            )
        )
    return fam


_BOOL_FIELDS = frozenset(
    f.name for f in dataclasses.fields(ModelArgs) if f.type in ("bool", bool)
)
"""`ModelArgs` fields that are flags (config.json may write them as 0 / 1)."""


def parse_hf_config(
    config: Mapping[str, Any], source: str = CONFIG_FILE
) -> tuple[dict[str, Any], list[str]]:
    """(`ModelArgs` field values, notes) for an HF ``config.json`` mapping (see the module
    docstring); `HFConfigError` listing every reason it cannot be built exactly."""
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    fam = family_of_config(config, problems)
    if fam is None or fam.hf is None:
        raise HFConfigError(source, problems)
    hf = fam.hf
    reader = Reader(config, hf.defaults, problems, notes)
    if hf.own_args:
        values = {"arch": fam.arch, **hf.read(reader)}
        if problems:
            raise HFConfigError(source, problems)
        return values, notes
    _check_keys(config, fam, hf, problems)
    ignored = {**IGNORED_KEYS, **hf.ignored}
    if found := sorted(set(config) & set(ignored)):
        owners = " / ".join(sorted({ignored[k] for k in found}))
        notes.append(NOTE_IGNORED.format(keys=", ".join(found), owners=owners))
    values: dict[str, Any] = {"arch": fam.arch}
    for name, key in COMMON_FIELDS.items():
        if key not in ("rope_theta", "partial_rotary_factor"):
            values[name] = reader.get(key)
    if values["num_kv_heads"] is None:  # transformers: num_key_value_heads = num_attention_heads
        values["num_kv_heads"] = values["num_heads"]
    if values["head_dim"] is None and _positive(values["hidden_size"], values["num_heads"]):
        # transformers: head_dim = hidden_size // num_attention_heads; stated, so a run config
        # restating the model (`model.head_dim: 128`) agrees with a file that leaves it out
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    values.update(read_rope(config, hf.defaults, problems))
    values.update(hf.read(reader))
    if fam.mtp:
        mtp = config.get(MTP_KEY)
        mtp = 0 if mtp is None else mtp  # a config class without the key; Glm4MoeConfig's default
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            problems.append(
                (MTP_KEY, f"{mtp!r} must be an integer >= 0 (the number of MTP layers)")
            )
        else:
            values["mtp_layers"] = mtp
            if mtp:
                notes.append(NOTE_MTP)
    for key in ("norm_eps", "initializer_range"):
        if is_number(values[key]):
            values[key] = float(values[key])
    keys = hf.all_fields
    for key in _BOOL_FIELDS & set(values):  # transformers tests a flag's truth: 0 / 1 are flags
        value = values[key]
        if not isinstance(value, bool) and is_number(value) and value in (0, 1):
            values[key] = bool(value)
        elif not isinstance(value, bool):
            problems.append((keys.get(key, key), f"{value!r} must be true or false"))
    for key, value in values.items():
        if key not in ("arch", "rope_scaling") and not isinstance(
            value, (int, float, bool, tuple, type(None))
        ):
            problems.append((keys.get(key, key), f"{value!r} must be a number or boolean"))
    if not problems:
        _check_family(fam, values, problems)
    if problems:
        raise HFConfigError(source, problems)
    return values, notes


def _check_keys(
    config: Mapping[str, Any], fam: Family, hf: HFSide, problems: list[tuple[str, str]]
) -> None:
    """Unknown keys, the common refusals, and the keys a library writes that change the maths."""
    known = COMMON_KEYS | hf.keys | _METADATA_KEYS | set(IGNORED_KEYS) | set(hf.ignored)
    known |= set(CHECKED_KEYS) | set(hf.checked) | ({MTP_KEY} if fam.mtp else set())
    unknown = sorted(set(config) - known)
    if unknown:
        problems.append(
            (
                "config.json",
                f"keys flashcp does not know for {hf.architecture}: {unknown}. They may change "
                "the model; if they are only metadata, remove them from config.json",
            )
        )
    if config.get("quantization_config") is not None:
        problems.append(
            ("quantization_config", "quantized checkpoints are not supported: use the bf16/fp32 "
                                    "weights")  # fmt: skip
        )
    act = config.get("hidden_act", hf.activation)
    if act != hf.activation:
        problems.append(
            ("hidden_act", f"{act!r}: {hf.architecture}'s MLPs here use {hf.activation!r}")
        )
    dropout = config.get("attention_dropout", 0.0)
    if not is_number(dropout) or dropout != 0:
        problems.append(
            (
                "attention_dropout",
                f"{dropout!r}: attention dropout is not implemented; set it to 0.0 in "
                "config.json to train without it",
            )
        )
    if config.get("use_sliding_window"):
        problems.append(("use_sliding_window", "sliding-window attention is not implemented"))
    for key, (allowed, why) in {**CHECKED_KEYS, **hf.checked}.items():
        if key in config and not any(_same_value(config[key], a) for a in allowed):
            shown = " or ".join(repr(a) for a in allowed)
            problems.append(
                (key, f"{config[key]!r} is not implemented ({why}): use a checkpoint with {shown}")
            )


def _check_family(fam: Family, values: dict[str, Any], problems: list[tuple[str, str]]) -> None:
    """What `values` would build, checked by the family's own rules (a value its class fixes
    that the file sets otherwise), reported under the config.json key."""
    keys = field_keys(fam.arch)
    try:
        args = ModelArgs(**values)
    except TypeError as exc:
        problems.append(("config.json", str(exc)))
        return

    def err(name: str, message: str) -> None:
        problems.append((keys.get(name, name), message))

    fam.validate(args, err)


def directory_notes(directory: str | os.PathLike[str], mtp_layers: int | None = None) -> list[str]:
    """The notes `parse_hf_config` gives for a model directory's config.json (keys accepted
    but ignored, MTP layers kept — or skipped when the run's `mtp_layers` is 0), each naming
    the directory; empty when it does not parse (its refusal is reported where the config is
    validated)."""
    try:
        config, source = read_config_json(directory)
        _, notes = parse_hf_config(config, source)
    except (OSError, ValueError):
        return []
    if mtp_layers == 0:
        notes = [NOTE_MTP_SKIPPED if n == NOTE_MTP else n for n in notes]
    return [f"{directory}: {note}" for note in notes]


def args_from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
) -> ModelArgs:
    """`ModelArgs` from a `config.json` (path, directory or mapping) of any registered family,
    flashcp GPT exports exactly; `HFConfigError` when that model cannot be built."""
    source = CONFIG_FILE
    if not isinstance(config, Mapping):
        config, source = read_config_json(config)
    values, _ = parse_hf_config(config, source)
    return ModelArgs(**{**values, **overrides}).check()


def exportable(args: ModelArgs) -> list[str]:
    """Why `args` is not what its family's HF class computes (empty when an HF export is
    exact): a rotary pairing other than the family's, and the family's own `HFSide.exact`."""
    fam = args.family
    if fam.hf is None:
        return [f"arch {args.arch} has no Hugging Face class"]
    problems = []
    if fam.hf.transformers and args.interleaved_rotary != fam.rotary_interleaved:
        problems.append(
            f"model.rotary_interleaved {args.rotary_interleaved}: {fam.hf.architecture} "
            f"rotates {'interleaved' if fam.rotary_interleaved else 'half-split'} pairs"
        )
    if fam.hf.exact is not None:
        problems += fam.hf.exact(args)
    return problems


def hf_config(
    args: ModelArgs,
    dtype: str = "float32",
    *,
    token_ids: Mapping[str, Any] | None = None,
    nulls: bool = False,
) -> dict[str, Any]:
    """The HF ``config.json`` of `args` (both RoPE layouts; GPT gets `ARGS_KEY`).

    `token_ids`: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` to record (e.g. those
    of the config.json the run started from); a None value is left out, or with `nulls`
    written as an explicit null (transformers then does not fill in its class default).
    `ValueError` when no HF class computes `args`.
    """
    problems = exportable(args)
    if problems:
        raise ValueError("this model has no exact Hugging Face config: " + "; ".join(problems))
    fam = args.family
    hf = fam.hf
    assert hf is not None
    cfg: dict[str, Any] = {
        "architectures": [hf.architecture],
        "model_type": hf.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rotary_base,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.initializer_range,
        "torch_dtype": dtype,
    }
    if not hf.transformers:
        cfg["partial_rotary_factor"] = args.partial_rotary_factor
    else:
        partial = "partial_rotary_factor" in hf.defaults or args.partial_rotary_factor != 1.0
        cfg.update(
            rms_norm_eps=args.norm_eps,
            hidden_act=hf.activation,
            attention_dropout=0.0,
            **rope_config(args, partial),
            use_cache=True,
        )
    cfg.update(hf.write(args))
    if fam.mtp and hf.transformers and (fam.is_moe or args.mtp_layers):
        cfg[MTP_KEY] = args.mtp_layers
    for key in TOKEN_ID_KEYS:
        if token_ids is not None and (token_ids.get(key) is not None or nulls and key in token_ids):
            cfg[key] = token_ids[key]
    return cfg
