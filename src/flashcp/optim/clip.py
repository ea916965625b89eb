"""THE global gradient norm: one computation per optimizer step, logged and used to clip.

Every layout computes it with the arithmetic of Paddle's `ClipGradByGlobalNorm` in one process
(`paddle/nn/clip.py`): one float32 squared norm per gradient (`squared_l2_norm`), summed in
float32 in the single-process parameter order, square root; clipping multiplies every gradient
by `clip / max(norm, clip)`. With float32 parameters on one stage that is Paddle's clip bit for
bit (`tests/unit/optim/test_clip.py`), and the norm in `metrics.jsonl` is the one that clipped.

A rank may hold only part of the model's gradients. Each rank writes the squares of the pieces
it holds into a vector indexed by the parameter's position in the WHOLE model, with a flag per
entry ("some rank has a gradient here"), then completes it:

* entries of tensors held in parts — an expert-parallel tensor (each ep rank holds its
  experts' rows), a ZeRO-1 shard's slices of the parameters (each rank of the dp × cp group
  its own elements) — are summed over the groups holding the other parts (`partial`); the
  other entries are equal on those ranks and left alone;
* the whole vector is summed over the pipeline stages (`stages`): each stage fills only its
  own entries, and a matrix held by two stages (a tied embedding: both copies carry the same,
  already summed gradient) is counted by its first holder only (`skip` on the other).

Adding zeros is exact, so every rank ends with the vector one process would build and sums it
the same way: pipeline stages are bitwise one process; a tensor held in parts gets the float32
sum of its parts' squares, within a few ulps of one process's square of the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import paddle
from paddle import _C_ops

from flashcp.config.schema import TrainConfig
from flashcp.distributed import all_reduce_tensor


class GlobalNorm:
    """The global gradient norm of one rank's layout (see the module docstring).

    `order`: structured names of the whole model's trainable parameters, in its
    `named_parameters()` order (one process's optimizer order). `skip`: names held here but
    counted by another stage. `partial`: name → the groups over which that tensor's squares
    are split (summed in that order). `stages`: the pipeline group (None: one stage).
    Every rank of a group must hold the same names in the same `partial` groups.
    """

    def __init__(
        self,
        order: Sequence[str],
        *,
        skip: Iterable[str] = (),
        partial: Mapping[str, Sequence[Any]] | None = None,
        stages: Any = None,
    ) -> None:
        self.index = {name: i for i, name in enumerate(order)}
        self.skip = set(skip)
        self.stages = stages if stages is not None and int(stages.nranks) > 1 else None
        classes: dict[tuple[int, ...], tuple[list[int], list[Any]]] = {}
        for name, groups in (partial or {}).items():
            if name not in self.index:
                raise ValueError(f"parameter {name!r} is not in the whole model's list")
            active = [g for g in groups if int(g.nranks) > 1]
            if active:
                key = tuple(id(g) for g in active)
                classes.setdefault(key, ([], active))[0].append(self.index[name])
        n = len(self.index)
        self.partial = [
            (paddle.to_tensor(sorted(at) + [n + i for i in sorted(at)], dtype="int64"), groups)
            for at, groups in classes.values()
        ]
        """(positions in the [squares, flags] vector, groups to sum them over)."""

    @paddle.no_grad()
    def __call__(self, grads: Iterable[tuple[str, paddle.Tensor | None]]) -> paddle.Tensor:
        """The float32 norm (0-D) of the `(structured name, gradient piece)` pairs held here
        (0 when no rank holds a gradient). Collective over the `partial` groups and stages."""
        n = len(self.index)
        at: list[int] = []
        squares = []
        for name, g in grads:
            if g is None or name in self.skip:
                continue
            if name not in self.index:
                raise ValueError(f"parameter {name!r} is not in the whole model's list")
            at.append(self.index[name])
            squares.append(_C_ops.squared_l2_norm(g).reshape([1]))
        if len(set(at)) != len(at):
            raise ValueError("a parameter's gradient was given twice")
        both = paddle.zeros([2 * n], dtype="float32")
        if at:
            where = paddle.to_tensor(at + [n + i for i in at], dtype="int64")
            flags = paddle.ones([len(at)], dtype="float32")
            both = paddle.scatter(both, where, paddle.concat([*squares, flags]))
        for where, groups in self.partial:
            part = paddle.gather(both, where)
            for group in groups:
                part = all_reduce_tensor(part, group)
            both = paddle.scatter(both, where, part)
        if self.stages is not None:
            both = all_reduce_tensor(both, self.stages)
        held = paddle.masked_select(both[:n], both[n:] > 0)
        if int(held.shape[0]) == 0:
            return paddle.zeros([], dtype="float32")
        return paddle.sqrt(held.sum())


def clip_factor(norm: paddle.Tensor, max_norm: float) -> paddle.Tensor:
    """`max_norm / max(norm, max_norm)` in float32 (0-D): what every gradient is multiplied by."""
    limit = paddle.full([], max_norm, dtype="float32")
    return paddle.divide(limit, paddle.maximum(norm, limit))


class NormOnce:
    """The step's global norm, computed once: by `grad_norm()` (the logged value) or, if it
    was not asked for, by `_clip()`, which scales the gradients with it."""

    norm: GlobalNorm
    train: TrainConfig
    """The optimizer's `GlobalNorm` and its `train` section (`grad_clip`)."""
    _norm: paddle.Tensor | None = None

    def _pieces(self) -> Iterable[tuple[str, paddle.Tensor | None]]:
        """`(structured name, gradient piece)` this rank holds, after `reduce_grads`."""
        raise NotImplementedError

    def _scale(self, factor: paddle.Tensor) -> None:
        """Multiply every gradient `step` uses by `factor`."""
        raise NotImplementedError

    def _step_norm(self) -> paddle.Tensor:
        if self._norm is None:
            self._norm = self.norm(self._pieces())
        return self._norm

    def _forget_norm(self) -> None:
        self._norm = None

    def grad_norm(self) -> float:
        """The global gradient norm (after `reduce_grads`; collective)."""
        return float(self._step_norm())

    @paddle.no_grad()
    def _clip(self) -> None:
        if self.train.grad_clip > 0:
            self._scale(clip_factor(self._step_norm(), self.train.grad_clip))
