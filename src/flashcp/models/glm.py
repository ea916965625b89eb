"""GLM-4 dense (`arch="glm"`) and GLM-4.5 mixture-of-experts (`arch="glm_moe"`) decoders.

Both: RMSNorm, partial rotary on the first `head_dim * partial_rotary_factor` dims of each
head, q/k/v projections with bias, GQA, bias-free o_proj and SwiGLU MLPs.

``glm`` follows HF ``Glm4ForCausalLM`` (GLM-4-0414), including its two extra norms::

    h = h + post_self_attn_layernorm(attn(input_layernorm(h)))
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

with interleaved rotary (pairs (2i, 2i+1)) and a fused ``mlp.gate_up_proj``.

``glm_moe`` follows HF ``Glm4MoeForCausalLM`` (GLM-4.5 / GLM-4.5-Air)::

    h = h + attn(input_layernorm(h))
    h = h + mlp(post_attention_layernorm(h))

with half-split (NeoX) rotary; `mlp` is a dense SwiGLU (``gate_proj``/``up_proj``/
``down_proj``, `intermediate_size`) for the first `first_k_dense_replace` layers and a
`flashcp.models.moe.MoE` after, and QK-norm when `use_qk_norm` (the full GLM-4.5; off in
GLM-4.5-Air; see `flashcp.models.attention.Attention`). GLM-4.5's multi-token-prediction
layers (`model.mtp_layers`, which HF ``Glm4MoeForCausalLM`` ignores) are these decoder layers
plus their own parts, on the last stage: `flashcp.models.mtp`.
"""

from __future__ import annotations

from functools import partial

import paddle

from flashcp.attention.context import AttentionContext
from flashcp.models.attention import Attention
from flashcp.models.base import CausalLM, DecoderLayer, StageSpec
from flashcp.models.config import ModelArgs
from flashcp.models.layers import RMSNorm, SwiGLU
from flashcp.models.moe import MoE


class GLMDecoderLayer(DecoderLayer):
    """One GLM-4 (dense, four norms) or GLM-4.5 (two norms, dense or MoE MLP) layer."""

    def __init__(self, args: ModelArgs, index: int, experts: range | None = None) -> None:
        super().__init__()
        self.index = index
        self.tile_tokens = args.tile_tokens
        self.residual_dtype = args.residual_dtype
        h, eps, std = args.hidden_size, args.norm_eps, args.initializer_range
        self.extra_norms = args.arch == "glm"
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp: paddle.nn.Layer
        if args.is_moe_layer(index):
            self.mlp = MoE(args, experts)
        else:
            self.mlp = SwiGLU(h, args.intermediate_size, fused=args.arch == "glm", std=std)
        if self.extra_norms:
            self.post_self_attn_layernorm = RMSNorm(h, eps)
            self.post_mlp_layernorm = RMSNorm(h, eps)

    def after(self, h: paddle.Tensor, o: paddle.Tensor, attn: AttentionContext) -> paddle.Tensor:
        a = self.self_attn.output(o)
        if self.extra_norms:
            a = self.post_self_attn_layernorm(a)
        h = h + a
        x = self.post_attention_layernorm(h)
        m = self.mlp(x, attn.group) if isinstance(self.mlp, MoE) else self.mlp(x)
        if self.extra_norms:
            m = self.post_mlp_layernorm(m)
        return h + m


class GLMForCausalLM(CausalLM):
    """`ModelArgs(arch="glm" | "glm_moe", ...)`; a stage with `ep_size` > 1 holds its ep
    rank's share of every MoE layer's routed experts."""

    def __init__(self, args: ModelArgs, *, stage: StageSpec | None = None) -> None:
        if args.arch not in ("glm", "glm_moe"):
            raise ValueError(f"GLMForCausalLM needs arch 'glm' or 'glm_moe', got {args.arch!r}")
        spec = stage or StageSpec.whole(args.num_layers)
        experts = spec.experts(args.num_experts) if args.arch == "glm_moe" else None
        super().__init__(args, partial(GLMDecoderLayer, experts=experts), RMSNorm, stage=stage)
