"""A family's Hugging Face side, as data (no Paddle): its ``architectures`` / ``model_type``
names, transformers' defaults for the keys a config.json may leave out, how its own keys map to
`ModelArgs` and back, which keys only steer another library (ignored with a note) or change the
maths (accepted at the value flashcp computes), and the checkpoint names that differ from
flashcp's parameter names.

The generic reader and writer (`flashcp.models.hf_config`) handle what every transformers
decoder shares (`COMMON_FIELDS`: widths, heads, norms' epsilon, tied embeddings, RoPE in both
layouts); a family's `HFSide.read` adds its own keys through a `Reader` and `HFSide.write`
writes them back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashcp.models.config import ModelArgs

COMMON_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
    "initializer_range": "initializer_range",
    "rotary_base": "rope_theta",
    "partial_rotary_factor": "partial_rotary_factor",
}
"""`ModelArgs` field → the config.json key every transformers decoder here names it by."""
COMMON_KEYS = frozenset(
    {
        *COMMON_FIELDS.values(),
        "architectures",
        "model_type",
        "hidden_act",
        "attention_dropout",
        "rope_scaling",
        "rope_parameters",
        "quantization_config",
    }
)
"""The config.json keys the generic reader handles for every family."""

PADDLEFORMERS_IGNORED: dict[str, str] = {
    "paddleformers_version": "PaddleFormers",
    "disable_ffn_model_parallel": "PaddleFormers",  # tensor parallelism of the MoE FFN
    "pp_seg_method": "PaddleFormers",  # how its pipeline cuts the layers
    "fuse_rms_norm": "PaddleFormers",  # a fused RMSNorm kernel, same maths
    "fd_fallback": "PaddleFormers",  # FastDeploy's stacked-experts module, same maths
    "using_flex_token": "PaddleFormers",  # its token dispatcher for expert parallelism
    "moe_subbatch_token_num_before_dispatch": "PaddleFormers",  # rows per dispatch call
    "seq_aux": "PaddleFormers",  # sequence-wise aux loss in its training: a loss, not the model
}
"""Keys PaddleFormers 1.2.0 writes into its GLM configs that steer only its own training or
inference (parallelism, kernels, its aux-loss style), never the model's function."""


def is_number(x: Any) -> bool:
    """A config.json value that is a number (JSON's true / false are not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Rename:
    """A checkpoint key that differs from flashcp's parameter name: flashcp's name ends with
    `ours`, the checkpoint's with `theirs` (same prefix), stored with shape `stored` (a
    function of flashcp's shape; same elements in the same order), e.g. ERNIE-4.5's
    ``mlp.moe_statics.e_score_correction_bias`` `[1, E]` for flashcp's
    ``mlp.gate.e_score_correction_bias`` `[E]`."""

    ours: str
    theirs: str
    stored: Callable[[list[int]], list[int]] | None = None


class Reader:
    """A config.json as a family's `HFSide.read` sees it: values with transformers' defaults
    for absent keys, and the problems and notes found so far."""

    def __init__(
        self,
        config: Mapping[str, Any],
        defaults: Mapping[str, Any],
        problems: list[tuple[str, str]],
        notes: list[str],
    ) -> None:
        self.config = config
        self.defaults = defaults
        self.problems = problems
        self.notes = notes

    def get(self, key: str) -> Any:
        """`key`'s value, or transformers' default when the file lacks it (or gives null)."""
        value = self.config.get(key)
        return self.defaults.get(key) if value is None else value

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def problem(self, key: str, message: str) -> None:
        self.problems.append((key, message))


@dataclass(frozen=True)
class HFSide:
    """The Hugging Face side of a family (module docstring).

    `architecture` is what exports write (and transformers' class, unless `transformers` is
    False: flashcp's own GPT); `aliases` are other ``architectures`` names read as this family
    (e.g. PaddleFormers' class names) with who writes them. `defaults` are transformers' config
    class defaults (5.3) for the keys read. `keys` are the family's own model keys beyond
    `COMMON_KEYS`; `fields` maps their `ModelArgs` fields to them (for messages).
    `read(reader)` returns the family's `ModelArgs` values beyond the common ones (problems go
    to the reader); `write(args)` the family's keys of an export. `exact(args)` says why `args`
    is not what the class computes (empty: an export is exact). `activation` is the MLP's
    ``hidden_act``."""

    architecture: str
    model_type: str
    defaults: Mapping[str, Any]
    read: Callable[[Reader], dict[str, Any]]
    write: Callable[[ModelArgs], dict[str, Any]]
    keys: frozenset[str] = frozenset()
    fields: Mapping[str, str] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    ignored: Mapping[str, str] = field(default_factory=dict)
    """Keys that steer only a library's own training or inference: key → the library."""
    checked: Mapping[str, tuple[tuple[Any, ...], str]] = field(default_factory=dict)
    """Keys that change the maths: key → (the values flashcp computes, why another is refused)."""
    renames: tuple[Rename, ...] = ()
    exact: Callable[[ModelArgs], list[str]] | None = None
    transformers: bool = True
    activation: str = "silu"
    unread: tuple[str, ...] = ()
    """Regular expressions of checkpoint keys the reference class never reads (searched, as
    transformers' ``_keys_to_ignore_on_load_unexpected``), e.g. ERNIE-4.5's ``mtp`` parts."""
    own_args: bool = False
    """The config.json carries the exact `ModelArgs` (flashcp's GPT exports): `read` gets the
    raw mapping and no key is checked."""

    @property
    def all_fields(self) -> dict[str, str]:
        return {**COMMON_FIELDS, **self.fields}


def tied_bias(reader: Reader, key: str) -> dict[str, Any]:
    """``attention_bias`` (Llama, Qwen3) or ``use_bias`` (ERNIE-4.5) biasing q, k, v and o."""
    bias = reader.get(key)
    return {"qkv_bias": bias, "o_bias": bias}


def moe_counts(reader: Reader, experts: str, top_k: str, shared: str | None) -> dict[str, Any]:
    """The routed-expert widths every MoE family has, under its own key names."""
    return {
        "num_experts": reader.get(experts),
        "num_experts_per_tok": reader.get(top_k),
        "moe_intermediate_size": reader.get("moe_intermediate_size"),
        "num_shared_experts": 0 if shared is None else reader.get(shared),
    }


WINDOW_KEYS = frozenset(
    {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
)
"""Qwen's sliding-window keys: every published Qwen2.5 / Qwen3 file writes them with
``use_sliding_window: false`` (then transformers computes full attention in every layer and
``sliding_window`` / ``max_window_layers`` change nothing); ``use_sliding_window: true`` is
refused by the generic reader."""


def full_attention_only(reader: Reader) -> None:
    """Refuse a ``layer_types`` list naming a layer other than ``full_attention`` (Qwen's
    per-layer attention kinds; flashcp computes full causal attention in every layer)."""
    kinds = reader.config.get("layer_types")
    if kinds is None:
        return
    if not isinstance(kinds, list) or any(k != "full_attention" for k in kinds):
        other = (
            sorted({str(k) for k in kinds} - {"full_attention"})
            if isinstance(kinds, list)
            else kinds
        )
        reader.problem(
            "layer_types",
            f"{other!r}: flashcp computes full causal attention in every layer; use a "
            "checkpoint whose layers are all full_attention (use_sliding_window false)",
        )
