"""What an optimizer knows of this rank's part of the model (`Trainable`: the trainable
parameters, the ones it holds only some rows of (`RowSlice`), the whole model's order, the tied
copy another stage counts), and the storage dtypes whose parameters get float32 master weights
and float32 `main_grad` accumulation (`attach_main_grad`).

The optimizer knows no architecture: which parameters are expert-parallel reaches it as data
(name → `RowSlice`, from its caller; the trainer reads them off the model,
`flashcp.models.expert_parallel.expert_tensors`), and the groups they are summed over are
`ParallelGroups`' (`edp`, `ep`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import paddle

from flashcp.distributed import ParallelGroups, all_gather_object
from flashcp.optim.grads import numel, trainable

LOW_PRECISION = ("bfloat16", "float16")
"""Storage dtypes whose parameters get float32 master weights and float32 `main_grad`."""


def dtype_name(t: paddle.Tensor) -> str:
    """`"float32"`, `"bfloat16"`, ... of a tensor."""
    return str(t.dtype).removeprefix("paddle.")


def low_precision_dtype(params: Sequence[paddle.Tensor]) -> str | None:
    """The low-precision storage dtype among `params` (None: all float32)."""
    found = {dtype_name(p) for p in params} & set(LOW_PRECISION)
    if len(found) > 1:
        raise ValueError(f"trainable parameters mix {sorted(found)}: use one storage dtype")
    return found.pop() if found else None


def attach_main_grad(model: paddle.nn.Layer, dtype: str) -> Any:
    """Float32 gradient accumulation for every parameter of `model`: fleet's
    `MixPrecisionLayer` hooks add each backward's gradient, cast to float32, into
    `param.main_grad` and release the low-precision one (`param.grad` stays None). Returns the
    wrapper (kept only to hold the hooks' owner; the model is used as it is)."""
    # fleet pulls in the whole hybrid-parallel stack: imported only for low-precision storage
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    return MixPrecisionLayer(model, dtype=dtype)


@dataclass(frozen=True)
class RowSlice:
    """The rows `[first, first + count)` a rank holds of a parameter whose full tensor has
    `total` along its leading axis (an expert-parallel tensor: one row per expert). Its
    gradients are summed over `edp`, not dp × cp, and its norm adds over `ep`."""

    first: int
    count: int
    total: int


def holder(params: Sequence[paddle.Tensor]) -> paddle.nn.Layer:
    """A layer holding just `params` (for `attach_main_grad` on some parameters only)."""
    holder = paddle.nn.Layer()
    for i, p in enumerate(params):
        holder.add_parameter(f"p{i}", p)
    return holder


@dataclass(frozen=True)
class Trainable:
    """What an optimizer needs to know about this rank's part of the model (`of`).

    `params`: trainable `(structured name, parameter)` pairs, in the model's order; `experts`:
    the expert-parallel ones (their rows of the full tensor; empty at ep = 1); `order`: the whole
    model's trainable names (every pipeline stage's, the optimizer order of one process);
    `skip`: names held here but counted by another stage (the last stage's copy of a tied
    embedding).
    """

    model: paddle.nn.Layer
    params: list[tuple[str, paddle.Tensor]]
    experts: dict[str, RowSlice]
    order: list[str]
    skip: set[str]

    @classmethod
    def of(
        cls,
        model: paddle.nn.Layer,
        groups: ParallelGroups,
        experts: Mapping[str, RowSlice] | None = None,
    ) -> Trainable:
        """From the model (this rank's stage), its groups and its expert-parallel parameters
        (`experts`: structured name → the rows held; required when ep > 1); collective over
        pp."""
        params = trainable(model)
        names = [n for n, _ in params]
        held_experts: dict[str, RowSlice] = {}
        if int(groups.ep.nranks) > 1:
            if experts is None:
                raise ValueError(
                    f"the ep group has {int(groups.ep.nranks)} ranks but the optimizer was not "
                    "told which parameters are expert-parallel: pass experts= (name → RowSlice)"
                )
            held = set(names)
            held_experts = {n: s for n, s in experts.items() if n in held}
        order = names
        if int(groups.pp.nranks) > 1:  # stages hold consecutive layers, in stage order
            parts = all_gather_object(names, groups.pp)
            order = list(dict.fromkeys(n for part in parts for n in part))
        tied = getattr(model, "tied_weight", None)
        skip: set[str] = set()
        if tied is not None and not getattr(model, "is_first", True):
            skip = {n for n, p in params if p is tied}
        return cls(model, params, held_experts, order, skip)

    @cached_property
    def by_name(self) -> dict[str, paddle.Tensor]:
        return dict(self.params)

    def first_element(self, name: str) -> int:
        """Where this rank's elements of parameter `name` start in the full tensor's
        (flattened): an expert-parallel tensor's first row held × elements per row, else 0."""
        piece = self.experts.get(name)
        if piece is None:
            return 0
        return piece.first * (numel(self.by_name[name]) // piece.count)

    def full_numel(self, name: str) -> int:
        """Elements of the full tensor of parameter `name` (all experts)."""
        n = numel(self.by_name[name])
        piece = self.experts.get(name)
        return n if piece is None else piece.total * (n // piece.count)
