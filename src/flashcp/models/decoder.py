"""The one decoder layer and causal LM of every model family, composed from the shared building
blocks its family declares (`flashcp.models.families.spec.LayerBlocks`): no family has a class
of its own.

    h = h + [post_self_attn_layernorm](attn(input_layernorm(h)))
    h = h + [post_mlp_layernorm](mlp(post_attention_layernorm(h)))

`input_layernorm` and `post_attention_layernorm` are RMSNorm or LayerNorm; `self_attn` the GQA
attention with the family's biases, QK-norm and rotary (`flashcp.models.attention`); `mlp` a
dense MLP (SwiGLU, fused or not, or GELU) or a mixture of experts with the family's router
(`flashcp.models.moe`); the bracketed "sandwich" norms only where the family has them (GLM-4).
Parameter names are the Hugging Face ones (``model.layers.{i}.self_attn.q_proj``,
``mlp.gate_up_proj`` or ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``, GPT's ``mlp.fc_in`` /
``fc_out``, ``mlp.experts``, ``mlp.shared_experts``), created in the order
`flashcp.models.families.inventory` lists them.
"""

from __future__ import annotations

from functools import partial

import paddle
from paddle import nn

from flashcp.attention.context import AttentionContext
from flashcp.models.attention import Attention
from flashcp.models.base import CausalLM, DecoderLayer, StageSpec
from flashcp.models.config import ModelArgs
from flashcp.models.families.spec import DenseMLP, MoEMLP, NormKind
from flashcp.models.layers import GeluMLP, RMSNorm, SwiGLU, layer_norm
from flashcp.models.moe import MoE


def make_norm(kind: NormKind) -> type[nn.Layer] | partial[nn.Layer]:
    """The norm factory `(hidden, eps) -> nn.Layer` of a family's `norm` kind."""
    return RMSNorm if kind == "rms" else layer_norm  # type: ignore[return-value]


def make_mlp(args: ModelArgs, mlp: DenseMLP | MoEMLP, experts: range | None) -> nn.Layer:
    """The MLP block `mlp` describes (routed experts: this stage's `experts`)."""
    std = args.initializer_range
    if isinstance(mlp, MoEMLP):
        return MoE(args, experts)
    if mlp.kind == "gelu":
        return GeluMLP(args.hidden_size, mlp.intermediate, std=std)
    return SwiGLU(args.hidden_size, mlp.intermediate, fused=mlp.fused, bias=mlp.bias, std=std)


class Block(DecoderLayer):
    """Decoder layer `index` (global) of `args`' family, from its `LayerBlocks`."""

    def __init__(self, args: ModelArgs, index: int, experts: range | None = None) -> None:
        super().__init__()
        blocks = args.layer_blocks(index)
        self.index = index
        self.tile_tokens = args.tile_tokens
        self.residual_dtype = args.residual_dtype
        h, eps = args.hidden_size, args.norm_eps
        norm = make_norm(blocks.norm)
        self.input_layernorm = norm(h, eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = norm(h, eps)
        self.mlp = make_mlp(args, blocks.mlp, experts)
        self.sandwich_norms = blocks.sandwich_norms
        if self.sandwich_norms:
            self.post_self_attn_layernorm = norm(h, eps)
            self.post_mlp_layernorm = norm(h, eps)

    def after(self, h: paddle.Tensor, o: paddle.Tensor, attn: AttentionContext) -> paddle.Tensor:
        a = self.self_attn.output(o)
        if self.sandwich_norms:
            a = self.post_self_attn_layernorm(a)
        h = h + a
        del a  # without gradients it dies here, before the MLP
        x = self.post_attention_layernorm(h)
        m = self.mlp(x, attn.group) if isinstance(self.mlp, MoE) else self.mlp(x)
        if self.sandwich_norms:
            m = self.post_mlp_layernorm(m)
        return h + m


class DecoderLM(CausalLM):
    """The causal LM of any registered family (`ModelArgs.arch`), or one pipeline stage of it;
    a stage with `ep_size` > 1 holds its ep rank's share of every MoE layer's routed experts."""

    def __init__(self, args: ModelArgs, *, stage: StageSpec | None = None) -> None:
        fam = args.family
        spec = stage or StageSpec.whole(args.num_layers)
        experts = spec.experts(args.num_experts) if fam.is_moe else None
        super().__init__(args, partial(Block, experts=experts), make_norm(fam.norm), stage=stage)
