"""GPT: a pre-LN decoder with LayerNorm, rotary or learned positions and a GELU MLP.

Per layer ``h = h + attn(ln1(h)); h = h + mlp(ln2(h))``, then a final LayerNorm and the LM
head (optionally tied to the token embedding). Checkpoint names (flashcp's own layout, in the
HF style of `flashcp.models.hf_weights`): ``model.embed_tokens``, ``model.embed_positions``
(learned positions only), ``model.layers.{i}.input_layernorm``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.post_attention_layernorm``,
``model.layers.{i}.mlp.{fc_in,fc_out}``, ``model.norm``, ``lm_head``.
"""

from __future__ import annotations

import paddle

from flashcp.attention.context import AttentionContext
from flashcp.models.attention import Attention
from flashcp.models.base import CausalLM, DecoderLayer, StageSpec
from flashcp.models.config import ModelArgs
from flashcp.models.layers import GeluMLP, layer_norm


class GPTDecoderLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.index = index
        self.tile_tokens = args.tile_tokens
        self.residual_dtype = args.residual_dtype
        self.input_layernorm = layer_norm(args.hidden_size, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = layer_norm(args.hidden_size, args.norm_eps)
        self.mlp = GeluMLP(args.hidden_size, args.intermediate_size, std=args.initializer_range)

    def after(self, h: paddle.Tensor, o: paddle.Tensor, attn: AttentionContext) -> paddle.Tensor:
        h = h + self.self_attn.output(o)
        return h + self.mlp(self.post_attention_layernorm(h))


class GPTForCausalLM(CausalLM):
    """`ModelArgs(arch="gpt", ...)`."""

    def __init__(self, args: ModelArgs, *, stage: StageSpec | None = None) -> None:
        if args.arch != "gpt":
            raise ValueError(f"GPTForCausalLM needs arch 'gpt', got {args.arch!r}")
        super().__init__(args, GPTDecoderLayer, layer_norm, stage=stage)
