"""PaddleFormers' own GLM-4.5 class on CPU: directories and adapters made by PaddleFormers
itself, and its forward as a reference.

``paddleformers.transformers.glm4_moe.modeling`` (PaddleFormers 1.2.0) imports, at module
level, two GPU packages that are not on PyPI and that its eager class
``Glm4MoeForCausalLMDeprecated`` never uses: ``paddlefleet`` (through ``gpt_provider``, the base
of the fleet class's ``GLMMoEModelProvider``) and ``paddlefleet_ops`` (through ``fused_a2a``,
DeepEP for its expert-parallel token dispatcher; it asks ``is_deep_ep_available()``).
`glm_classes` imports the module with a stand-in for exactly those two names — a provider
base that raises if the fleet class is built, and "DeepEP is not available" — and removes the
stand-ins from ``sys.modules`` again, so nothing else (flashcp's FA4 probe of
``paddlefleet_ops``) ever sees them. Everything the tests run — the config class, the eager
model, ``save_pretrained`` / ``from_pretrained`` with its fused ``qkv_proj`` / ``up_gate_proj``
conversion, ``LoRAModel`` — is PaddleFormers' unchanged code.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from flashcp.models import ModelArgs

_STANDINS = ("paddleformers.transformers.gpt_provider", "paddlefleet_ops")
_CLASSES: list[Any] = []


class _NoFleetProvider:
    """The base `GLMMoEModelProvider` derives from; only the fleet class would use it."""

    transform_rules: dict[str, str] = {}

    @classmethod
    def from_config(cls, config: Any) -> Any:
        raise RuntimeError("PaddleFormers' fleet GLM class needs paddlefleet (GPU only)")


@contextlib.contextmanager
def _standins() -> Iterator[None]:
    provider = types.ModuleType(_STANDINS[0])
    provider.GPTModelProvider = _NoFleetProvider  # type: ignore[attr-defined]
    ops = types.ModuleType(_STANDINS[1])
    ops.is_deep_ep_available = lambda: False  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in _STANDINS}
    sys.modules.update({_STANDINS[0]: provider, _STANDINS[1]: ops})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def glm_classes() -> tuple[Any, Any]:
    """PaddleFormers' (``Glm4MoeConfig``, ``Glm4MoeForCausalLMDeprecated``)."""
    if not _CLASSES:
        with _standins():
            from paddleformers.transformers.glm4_moe import configuration, modeling
        _CLASSES.extend([configuration.Glm4MoeConfig, modeling.Glm4MoeForCausalLMDeprecated])
    return _CLASSES[0], _CLASSES[1]


def glm_config(args: ModelArgs) -> Any:
    """PaddleFormers' ``Glm4MoeConfig`` of the GLM-4.5 model `args` describes, set up to run
    on CPU as a PaddleFormers user does: float32, eager attention, ``fuse_rms_norm: false``
    (its fused RMSNorm kernel is GPU-only; the setting is saved in config.json)."""
    config_cls, _ = glm_classes()
    return config_cls(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_size,
        partial_rotary_factor=args.partial_rotary_factor,
        rope_theta=args.rotary_base,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        attention_bias=args.qkv_bias,
        use_qk_norm=args.use_qk_norm,
        moe_intermediate_size=args.moe_intermediate_size,
        num_experts_per_tok=args.num_experts_per_tok,
        n_shared_experts=args.num_shared_experts,
        n_routed_experts=args.num_experts,
        routed_scaling_factor=args.routed_scaling_factor,
        first_k_dense_replace=args.first_k_dense_replace,
        norm_topk_prob=args.norm_topk_prob,
        tie_word_embeddings=args.tie_embeddings,
        num_nextn_predict_layers=0,
        dtype="float32",
        fuse_rms_norm=False,
        _attn_implementation="eager",
    )


def random_glm(args: ModelArgs, seed: int) -> Any:
    """PaddleFormers' eager GLM-4.5 model of `args` with every parameter and the routers'
    ``e_score_correction_bias`` drawn from `seed` (norm weights near 1), so a load that swaps
    or drops any tensor shows in the logits."""
    _, model_cls = glm_classes()
    model = model_cls(glm_config(args))
    rng = np.random.default_rng(seed)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        shape = [int(d) for d in tensor.shape]
        value = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if "norm" in name:
            value += np.float32(1.0)
        tensor.set_value(value.astype(tensor.numpy().dtype))
    model.eval()
    return model


def save_glm(model: Any, directory: Path) -> Path:
    """`model.save_pretrained(directory)`: the directory as PaddleFormers writes it."""
    model.save_pretrained(str(directory))
    return directory


def load_glm(directory: Path) -> Any:
    """``Glm4MoeForCausalLMDeprecated.from_pretrained(directory)`` as a CPU user calls it:
    float32, eager attention, no fused RMSNorm kernel; in eval mode."""
    config_cls, model_cls = glm_classes()
    config = config_cls.from_pretrained(str(directory))
    config.fuse_rms_norm = False
    config._attn_implementation = "eager"
    model = model_cls.from_pretrained(str(directory), config=config, dtype="float32")
    model.eval()
    return model


def glm_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    """PaddleFormers' float32 logits of token rows `ids` `[B, S]` (causal, positions 0..S-1)."""
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(ids), return_dict=True)
    return out.logits.astype("float32").numpy()
