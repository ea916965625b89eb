"""Global-norm gradient clipping across pipeline stages, bit-for-bit like one process.

Under pipeline parallelism each rank holds one stage's parameters, so Paddle's
`ClipGradByGlobalNorm` would clip each stage by its OWN norm. `PipelineGlobalNormClip`
computes the norm of the whole model instead, with exactly the arithmetic Paddle's clip uses in
one process: one float32 squared norm per parameter, summed in the single-process parameter
order, square root, `clip / max(norm, clip)`, multiplied into every gradient.

To get the single-process order, each stage writes its parameters' squared norms into a vector
indexed by the parameter's position in the FULL model (zeros elsewhere) and the vectors are
summed over the pp group: adding zeros is exact, so every stage ends up with the vector one
process would have built, and sums it the same way. A matrix held by two stages (tied
embeddings: both copies carry the same, already summed gradient) is counted once, by its first
holder. The clipped gradients therefore equal the single-process ones bitwise (tested in
`tests/unit/test_trainer_clip.py` against Paddle's clip).

Expert parallelism: an expert-parallel tensor (`experts`) is held in parts, each ep rank its
own experts' rows, so its squared norm is the SUM of the ep ranks' parts: those entries are
all-reduced over the ep group first (the other entries are equal on every ep rank and are left
alone). The result is the whole tensor's norm up to float32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
from paddle import _C_ops

from flashcp.distributed import all_reduce_tensor


class PipelineGlobalNormClip(paddle.nn.ClipGradByGlobalNorm):
    """`ClipGradByGlobalNorm(clip_norm)` over the parameters of every pipeline stage.

    `global_names`: structured names of the FULL model's trainable parameters, in its
    `named_parameters()` order (the optimizer order of one process). `names`: this stage's
    `(structured name, parameter)` pairs. `skip`: names held here but counted by another stage
    (the last stage's copy of a tied embedding). `group`: the pp group (trivial: one process).
    `experts`: names of expert-parallel tensors, whose squares are summed over `ep_group`.
    """

    def __init__(
        self,
        clip_norm: float,
        *,
        global_names: Sequence[str],
        names: Sequence[tuple[str, paddle.Tensor]],
        group: Any,
        skip: Sequence[str] = (),
        experts: Sequence[str] = (),
        ep_group: Any = None,
    ) -> None:
        super().__init__(clip_norm)
        self.index = {name: i for i, name in enumerate(global_names)}
        self.by_param = {p.name: name for name, p in names}
        unknown = sorted(set(self.by_param.values()) - set(self.index))
        if unknown:
            raise ValueError(f"parameters {unknown[:3]} are not in the full model's list")
        self.group = group
        self.skip = set(skip)
        self.ep_group = ep_group
        self.experts = np.zeros(len(self.index), dtype=bool)
        for name in experts:
            if name in self.index:
                self.experts[self.index[name]] = True

    def global_squares(self, params_grads: Sequence[tuple[Any, Any]]) -> np.ndarray:
        """The float32 squared norm of every clipped gradient of the whole model, in the
        single-process order (collective over the pp group)."""
        n = len(self.index)
        values = np.zeros(n, dtype=np.float32)
        present = np.zeros(n, dtype=np.float32)
        for p, g in params_grads:
            if g is None or getattr(p, "need_clip", True) is False:
                continue
            name = self.by_param[p.name]
            if name in self.skip:
                continue
            i = self.index[name]
            values[i] = float(_C_ops.squared_l2_norm(g).reshape([-1]).numpy()[0])
            present[i] = 1.0
        if self.ep_group is not None and int(self.ep_group.nranks) > 1 and self.experts.any():
            parts = all_reduce_tensor(paddle.to_tensor(values[self.experts]), self.ep_group)
            values[self.experts] = parts.numpy()
        both = paddle.to_tensor(np.concatenate([values, present]))
        if self.group is not None and int(self.group.nranks) > 1:
            both = all_reduce_tensor(both, self.group)
        arr = both.numpy()
        return arr[:n][arr[n:] > 0]

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):  # type: ignore[no-untyped-def, override]
        squares = self.global_squares(params_grads)
        if squares.size == 0:
            return params_grads
        total = paddle.stack([paddle.to_tensor(v) for v in squares]).sum()
        norm = paddle.sqrt(total)
        max_norm = paddle.full(shape=[1], dtype="float32", fill_value=self.clip_norm)
        scale = paddle.divide(x=max_norm, y=paddle.maximum(x=norm, y=max_norm))
        out = []
        for p, g in params_grads:
            if g is None:
                continue  # as Paddle's clip: parameters without a gradient are dropped
            if getattr(p, "need_clip", True) is False:
                out.append((p, g))
                continue
            factor = scale.astype(g.dtype) if scale.dtype != g.dtype else scale
            out.append((p, paddle.multiply(g, factor)))
        return out
