"""Building blocks shared by the model families: linear/embedding, norms, rotary, MLPs.

Every parameter is created with a recorded init rule (`flashcp.models.init`) so
`build_model` can give it its (seed, name)-keyed value, and every layer accepts weights stored
in another dtype than its activations (`flashcp.models.precision`: bf16 storage on CPU).

Parameter names follow the Hugging Face layouts (`gate_up_proj`, `down_proj`, ...) so
`flashcp.models.hf_state` maps a Paddle name to a checkpoint key by identity; only Linear
weights differ, by a transpose (Paddle stores `[in, out]`, HF `[out, in]`).

Rotary conventions (`rotary_dim` leading dims of each head rotate, the rest pass through):

* interleaved (HF ``Glm4``, GPT-J style): pair (2i, 2i+1) turns by angle ``pos * f_i``;
* half-split (HF ``Glm4Moe``/GPT-NeoX/Llama): pair (i, i + rotary_dim/2) turns by ``pos * f_i``;

with ``f_i = base ** (-2i / rotary_dim)``. The angle uses the token's GLOBAL position, so a
context-parallel shard computes exactly what the unsharded sequence would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from flashcp.models import cpu_elementwise
from flashcp.models.init import normal_attr, ones_attr, zeros_attr
from flashcp.models.precision import as_dtype, cast_linear, needs_cast


class Linear(nn.Linear):
    """`nn.Linear` whose weight may be stored in another dtype than the activations (bf16
    storage on CPU): it is upcast inside `forward` by `cast_linear` (a no-op when equal)."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if not needs_cast(x, self.weight, self.bias):
            return super().forward(x)
        return cast_linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """`nn.Embedding` whose output is float32 whatever the storage dtype: the residual stream
    (and what pipeline stages exchange) stays float32, as with float32 weights."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = super().forward(x)
        return out if out.dtype == paddle.float32 else out.astype("float32")


def linear(in_features: int, out_features: int, *, bias: bool, std: float) -> Linear:
    """`Linear` (weight `[in, out]`) with normal weights and zero bias."""
    return Linear(
        in_features,
        out_features,
        weight_attr=normal_attr(std),
        bias_attr=zeros_attr() if bias else False,
    )


def embedding(num: int, dim: int, *, std: float) -> Embedding:
    return Embedding(num, dim, weight_attr=normal_attr(std))


# ----------------------------------------------------------------------------------- norms


class RMSNorm(nn.Layer):
    """`x / sqrt(mean(x²) + eps) * weight`, computed in float32 (as HF's GLM RMSNorm)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = self.create_parameter([hidden], attr=ones_attr())

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        weight = as_dtype(self.weight, x.dtype)  # bf16 storage: cast, as below
        if cpu_elementwise.applies(x, weight):
            return cpu_elementwise.rms_norm(x, weight, self.eps)
        dtype = x.dtype
        h = x.astype("float32")
        h = h * paddle.rsqrt(h.pow(2).mean(axis=-1, keepdim=True) + self.eps)
        return weight * h.astype(dtype)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with its scale and shift cast to the input dtype (bf16 storage)."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if all(t is None or t.dtype == x.dtype for t in (self.weight, self.bias)):
            return super().forward(x)
        return F.layer_norm(
            x,
            normalized_shape=self._normalized_shape,
            weight=as_dtype(self.weight, x.dtype),
            bias=as_dtype(self.bias, x.dtype),
            epsilon=self._epsilon,
        )


def layer_norm(hidden: int, eps: float) -> LayerNorm:
    """LayerNorm with weight 1 and bias 0 (GPT)."""
    return LayerNorm(hidden, epsilon=eps, weight_attr=ones_attr(), bias_attr=zeros_attr())


# ---------------------------------------------------------------------------------- rotary


@dataclass(frozen=True)
class RotaryTables:
    """cos/sin `[B, L, 1, rotary_dim/2]` (float32) for one batch of global positions."""

    cos: paddle.Tensor
    sin: paddle.Tensor
    rotary_dim: int
    interleaved: bool


def rotary_tables(
    positions: paddle.Tensor, inv_freq: np.ndarray, *, interleaved: bool
) -> RotaryTables:
    """Angles for `positions` `[B, L]` (int, global token positions) at the inverse
    frequencies `inv_freq` (`flashcp.models.rope`)."""
    inv = paddle.to_tensor(inv_freq, place=positions.place)
    angles = positions.astype("float32").unsqueeze(-1) * inv  # [B, L, r/2]
    angles = angles.unsqueeze(2)  # broadcast over heads
    return RotaryTables(paddle.cos(angles), paddle.sin(angles), 2 * len(inv_freq), interleaved)


def apply_rotary(x: paddle.Tensor, tables: RotaryTables) -> paddle.Tensor:
    """Rotate the first `rotary_dim` dims of each head of `x` `[B, L, H, D]`."""
    r = tables.rotary_dim
    if cpu_elementwise.applies(x, tables.cos):
        return cpu_elementwise.rotary(
            x, tables.cos, tables.sin, rotary_dim=r, interleaved=tables.interleaved
        )
    d = int(x.shape[-1])
    rot = x[..., :r] if r < d else x
    cos, sin = tables.cos.astype(x.dtype), tables.sin.astype(x.dtype)
    if tables.interleaved:
        pairs = rot.reshape([*rot.shape[:-1], r // 2, 2])
        x1, x2 = pairs[..., 0], pairs[..., 1]
        turned = paddle.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        turned = turned.reshape(rot.shape)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        turned = paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if r < d:
        return paddle.concat([turned, x[..., r:]], axis=-1)
    return turned


# ------------------------------------------------------------------------------------ MLPs


class GeluMLP(nn.Layer):
    """GPT MLP: `fc_out(gelu(fc_in(x)))`, exact (erf) GELU, biased projections."""

    def __init__(self, hidden: int, intermediate: int, *, std: float) -> None:
        super().__init__()
        self.fc_in = linear(hidden, intermediate, bias=True, std=std)
        self.fc_out = linear(intermediate, hidden, bias=True, std=std)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class SwiGLU(nn.Layer):
    """`down_proj(silu(gate) * up)` (the MLPs, shared experts and dense layers of every family
    but GPT), bias-free unless `bias` (Llama's ``mlp_bias``, ERNIE-4.5's ``use_bias``).

    `fused=True` keeps gate and up in one `gate_up_proj` (HF ``Glm4MLP``; the gate is the
    first half of its outputs); `fused=False` uses `gate_proj` and `up_proj` (HF
    ``Glm4MoeMLP``, ``LlamaMLP``, ``Qwen3MLP``, ``Ernie4_5MLP``...).
    """

    def __init__(
        self, hidden: int, intermediate: int, *, fused: bool, std: float, bias: bool = False
    ) -> None:
        super().__init__()
        self.fused = fused
        self.intermediate = intermediate
        if fused:
            self.gate_up_proj = linear(hidden, 2 * intermediate, bias=bias, std=std)
        else:
            self.gate_proj = linear(hidden, intermediate, bias=bias, std=std)
            self.up_proj = linear(hidden, intermediate, bias=bias, std=std)
        self.down_proj = linear(intermediate, hidden, bias=bias, std=std)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.fused:
            gate, up = paddle.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = F.silu(gate) * up
        del gate, up  # without gradients they die before the down GEMM
        return self.down_proj(act)
