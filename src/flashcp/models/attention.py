"""The self-attention module of every model family.

Projections, optional QK-norm and rotary here; the attention itself goes through
`flashcp.attention`: the registry picks the implementation for the step's
`AttentionContext` (local, or the CP mode's implementation with a CP group of more than one
rank), the context plans the call once per micro-batch, and `flashcp.models.recompute.attend`
runs it — plainly, or pinned and replayed under activation recompute. This module knows no
implementation.
"""

from __future__ import annotations

import paddle
from paddle import nn

from flashcp.attention import registry
from flashcp.attention.context import AttentionContext
from flashcp.models import recompute
from flashcp.models.config import ModelArgs
from flashcp.models.layers import RMSNorm, RotaryTables, apply_rotary, linear


class Attention(nn.Layer):
    """GQA self-attention: q/k/v projections (optional bias), optional QK-norm, rotary,
    FlashMask, o_proj (optional bias, `ModelArgs.o_bias`).

    QK-norm (`ModelArgs.use_qk_norm`: GLM-4.5, Qwen3): `q_norm` / `k_norm` are RMSNorms over one
    head (`head_dim` weights, `norm_eps`) applied to every head of q and k BEFORE rotary, as HF
    ``Glm4MoeAttention`` and ``Qwen3Attention`` do (checkpoint keys ``self_attn.q_norm.weight``
    / ``k_norm.weight``).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hd, std = args.head_size, args.initializer_range
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        self.q_proj = linear(args.hidden_size, args.num_heads * hd, bias=args.qkv_bias, std=std)
        self.k_proj = linear(args.hidden_size, args.num_kv_heads * hd, bias=args.qkv_bias, std=std)
        self.v_proj = linear(args.hidden_size, args.num_kv_heads * hd, bias=args.qkv_bias, std=std)
        self.o_proj = linear(args.num_heads * hd, args.hidden_size, bias=args.o_bias, std=std)
        self.use_qk_norm = bool(args.use_qk_norm)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(
        self, x: paddle.Tensor, rotary: RotaryTables | None, ctx: AttentionContext
    ) -> paddle.Tensor:
        q, k, v = self.project(x, rotary)
        return self.output(self.core(q, k, v, ctx))

    def project(
        self, x: paddle.Tensor, rotary: RotaryTables | None
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """The token-wise part before attention: q `[B, L, Hq, D]`, k and v `[B, L, Hkv, D]`
        (projections, QK-norm, rotary); `flashcp.models.tiling` runs it over tiles."""
        b, s = int(x.shape[0]), int(x.shape[1])
        q = self.q_proj(x).reshape([b, s, self.num_heads, self.head_dim])
        k = self.k_proj(x).reshape([b, s, self.num_kv_heads, self.head_dim])
        v = self.v_proj(x).reshape([b, s, self.num_kv_heads, self.head_dim])
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        return q, k, v

    def output(self, out: paddle.Tensor) -> paddle.Tensor:
        """o_proj of the attention output `[B, L, Hq, D]` → `[B, L, hidden]` (token-wise)."""
        b, s = int(out.shape[0]), int(out.shape[1])
        return self.o_proj(out.reshape([b, s, self.num_heads * self.head_dim]))

    # ------------------------------------------------------------------ the kernel call

    def core(self, q, k, v, ctx: AttentionContext) -> paddle.Tensor:
        """Attention through the interface: the registry's implementation for `ctx`, the
        context's plan (one per micro-batch), pinned or replayed under recompute."""
        impl = registry.implementation_for(ctx)
        return recompute.attend(impl, ctx.plan(impl, q, k, v), q, k, v)
