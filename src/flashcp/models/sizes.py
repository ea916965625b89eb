"""Shipped model presets: CPU-sized ones for tests and smoke runs, and two real GLM shapes.

`glm4_9b` (HF ``THUDM/GLM-4-9B-0414``) and `glm45_air` (HF ``zai-org/GLM-4.5-Air``) carry the
public `config.json` shapes. They are *built only on GPU* (`build_model` refuses them on
CPU, where they would need tens of GB) but *validated everywhere*: `preset("glm45_air")`
returns checked `ModelArgs` on any machine, so configs that use them fail early and clearly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashcp.models.config import ModelArgs

BYTE_VOCAB = 260  # 256 byte values + a few specials (the byte tokenizer's vocabulary)


@dataclass(frozen=True)
class Preset:
    args: ModelArgs
    gpu_only: bool
    note: str


_TINY = dict(
    vocab_size=BYTE_VOCAB,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=256,
)
_SMALL = dict(
    vocab_size=BYTE_VOCAB,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    max_seq_len=1024,
)
_GLM = dict(partial_rotary_factor=0.5, qkv_bias=True)
_TINY_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_shared_experts=1,
    first_k_dense_replace=1,
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(ModelArgs(arch="gpt", intermediate_size=256, **_TINY), False, "CPU tests"),
    "tiny_glm": Preset(
        ModelArgs(arch="glm", intermediate_size=128, **_TINY, **_GLM), False, "CPU tests"
    ),
    "tiny_glm_moe": Preset(
        ModelArgs(arch="glm_moe", intermediate_size=128, **_TINY, **_GLM, **_TINY_MOE),
        False,
        "CPU tests",
    ),
    "small": Preset(ModelArgs(arch="gpt", intermediate_size=1024, **_SMALL), False, "CPU runs"),
    "small_glm": Preset(
        ModelArgs(arch="glm", intermediate_size=704, **_SMALL, **_GLM), False, "CPU runs"
    ),
    "glm4_9b": Preset(
        ModelArgs(
            arch="glm",
            vocab_size=151552,
            hidden_size=4096,
            num_layers=40,
            num_heads=32,
            num_kv_heads=2,
            head_dim=128,
            intermediate_size=13696,
            max_seq_len=32768,
            rotary_base=10000.0,
            norm_eps=1e-5,
            **_GLM,
        ),
        True,
        "GLM-4-9B-0414 shape; built only on GPU, validated everywhere",
    ),
    "glm45_air": Preset(
        ModelArgs(
            arch="glm_moe",
            vocab_size=151552,
            hidden_size=4096,
            num_layers=46,
            num_heads=96,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=10944,
            max_seq_len=131072,
            rotary_base=1000000.0,
            norm_eps=1e-5,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=1408,
            num_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            mtp_layers=1,
            **_GLM,
        ),
        True,
        "GLM-4.5-Air shape with its MTP (NextN) layer, frozen unless model.mtp_loss_weight > 0; "
        "built only on GPU, validated everywhere",
    ),
}


def preset(name: str, **overrides: object) -> ModelArgs:
    """The checked `ModelArgs` of a preset, with field overrides applied."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not known: use one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name].args, **overrides).check()  # type: ignore[arg-type]
