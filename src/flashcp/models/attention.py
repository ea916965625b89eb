"""The self-attention module of every model family, and `AttentionContext`.

`AttentionContext` is what one forward pass needs to know about attention beyond the
activations: the GLOBAL FlashMask mask (every CP rank keeps all of it), its `causal` flag,
and the CP group/layout. With a CP group of more than one rank each layer calls
`flashcp.cp.flashmask_attention_cp` on its local Q/K/V shards; otherwise it calls
`flashcp.attention.flashmask_attention` on the whole sequence. Under activation recompute the
call goes through a `PinnedAttention` (see `flashcp.models.recompute`) so the FlashAttention
version is resolved once per layer per step; the pins live with the recompute call, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle
from paddle import nn

from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.flashmask import flashmask_attention
from flashcp.masks import as_numpy
from flashcp.models import recompute
from flashcp.models.config import ModelArgs
from flashcp.models.layers import RMSNorm, RotaryTables, apply_rotary, linear
from flashcp.models.recompute import Phase, PinnedAttention


@dataclass
class AttentionContext:
    """Per-step attention inputs shared by all layers.

    `mask` is the GLOBAL `startend_row_indices` (int32 `[B, Hm, S, C]`, numpy or paddle) or
    None (then `causal` alone decides; CP needs a mask). `group` is the CP process group (None
    or one rank: no CP), `assignment` its chunk layout (None: derived from `mode`).
    """

    mask: Any
    causal: bool
    group: Any = None
    assignment: Any = None
    mode: str = "dualchunk_allgather"
    fa4_unavailable: str | None = None
    _tensor_cache: dict[str, paddle.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def uses_cp(self) -> bool:
        """Whether attention is context-parallel (a group of more than one rank)."""
        return self.group is not None and int(self.group.nranks) > 1

    def mask_tensor(self, place: Any) -> paddle.Tensor | None:
        """The mask as a paddle int32 tensor on `place`, converted once per context."""
        if self.mask is None:
            return None
        if isinstance(self.mask, paddle.Tensor) and str(self.mask.place) == str(place):
            return self.mask
        key = str(place)
        if key not in self._tensor_cache:
            arr = np.ascontiguousarray(as_numpy(self.mask))
            self._tensor_cache[key] = paddle.to_tensor(arr, place=place)
        return self._tensor_cache[key]


def use_cp(ctx: AttentionContext) -> bool:
    """The CP-or-not decision (module-level so single-process tests can force the CP path)."""
    return ctx.uses_cp


class Attention(nn.Layer):
    """GQA self-attention: q/k/v projections (optional bias), optional QK-norm, rotary,
    FlashMask, o_proj.

    QK-norm (`ModelArgs.use_qk_norm`, GLM-4.5): `q_norm` / `k_norm` are RMSNorms over one head
    (`head_dim` weights, `norm_eps`) applied to every head of q and k BEFORE rotary, as HF
    ``Glm4MoeAttention`` does (checkpoint keys ``self_attn.q_norm.weight`` / ``k_norm.weight``).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hd, std = args.head_size, args.initializer_range
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        self.q_proj = linear(args.hidden_size, args.num_heads * hd, bias=args.qkv_bias, std=std)
        self.k_proj = linear(args.hidden_size, args.num_kv_heads * hd, bias=args.qkv_bias, std=std)
        self.v_proj = linear(args.hidden_size, args.num_kv_heads * hd, bias=args.qkv_bias, std=std)
        self.o_proj = linear(args.num_heads * hd, args.hidden_size, bias=False, std=std)
        self.use_qk_norm = bool(args.use_qk_norm)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(
        self, x: paddle.Tensor, rotary: RotaryTables | None, ctx: AttentionContext
    ) -> paddle.Tensor:
        b, s = int(x.shape[0]), int(x.shape[1])
        q = self.q_proj(x).reshape([b, s, self.num_heads, self.head_dim])
        k = self.k_proj(x).reshape([b, s, self.num_kv_heads, self.head_dim])
        v = self.v_proj(x).reshape([b, s, self.num_kv_heads, self.head_dim])
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        out = self.core(q, k, v, ctx)
        return self.o_proj(out.reshape([b, s, self.num_heads * self.head_dim]))

    # ------------------------------------------------------------------ the kernel call

    def core(self, q, k, v, ctx: AttentionContext) -> paddle.Tensor:
        """FlashMask attention, plain or through the recompute pin of this layer."""
        state = recompute.current_state()
        if state is None:
            return self._direct(q, k, v, ctx)
        if state.phase is Phase.FIRST:
            pinned = self._pin(q, k, v, ctx)
            out, lse = pinned.forward_no_grad(q, k, v)
            if state.mode == "refined":
                pinned.out, pinned.lse = out, lse
            state.pins.append(pinned)
            return out
        pinned = state.next_pin()
        if tuple(int(s) for s in q.shape) != pinned.q_shape:
            raise RuntimeError(
                f"recompute replay got q {list(q.shape)} but the pinned call had "
                f"{list(pinned.q_shape)}: the layer's replay differs from its first pass"
            )
        if state.mode == "refined":
            return recompute.StoredAttentionFn.apply(q, k, v, pinned)
        return pinned.forward_with_grad(q, k, v)

    def _direct(self, q, k, v, ctx: AttentionContext) -> paddle.Tensor:
        if use_cp(ctx):
            return flashmask_attention_cp(
                q,
                k,
                v,
                as_numpy(ctx.mask) if ctx.mask is not None else None,
                group=ctx.group,
                causal=ctx.causal,
                mode=ctx.mode,
                assignment=ctx.assignment,
                fa4_unavailable=ctx.fa4_unavailable,
            )
        return flashmask_attention(
            q,
            k,
            v,
            ctx.mask_tensor(q.place),
            causal=ctx.causal,
            fa4_unavailable=ctx.fa4_unavailable,
        )

    def _pin(self, q, k, v, ctx: AttentionContext) -> PinnedAttention:
        if use_cp(ctx):
            return recompute.pin_attention(
                q,
                k,
                v,
                as_numpy(ctx.mask) if ctx.mask is not None else None,
                causal=ctx.causal,
                fa4_unavailable=ctx.fa4_unavailable,
                cp=True,
                group=ctx.group,
                mode=ctx.mode,
                assignment=ctx.assignment,
            )
        return recompute.pin_attention(
            q,
            k,
            v,
            ctx.mask_tensor(q.place),
            causal=ctx.causal,
            fa4_unavailable=ctx.fa4_unavailable,
        )
