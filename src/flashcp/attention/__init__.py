"""Attention: the FlashMask front door, and the context-parallel implementations.

* `flashcp.attention.flashmask`: `flashmask_attention` on this rank's whole sequence —
  validate, resolve the FlashAttention version once, one `PyLayer` on that version.
* `flashcp.attention.allgather_kv`: `flashmask_attention_cp`, the all-gather-KV
  context-parallel attention (Llama 3 / PaddleFleet style) over a CP group.
"""

from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.flashmask import (
    FlashMaskAttentionFn,
    dispatch_call_shape,
    flashmask_attention,
    flashmask_attention_with_version,
    validate_attention_inputs,
)

__all__ = [
    "FlashMaskAttentionFn",
    "dispatch_call_shape",
    "flashmask_attention",
    "flashmask_attention_cp",
    "flashmask_attention_with_version",
    "validate_attention_inputs",
]
