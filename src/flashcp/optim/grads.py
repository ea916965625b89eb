"""Gradient and statistic synchronisation over the cp and dp groups.

Under context parallelism each rank's parameter gradients are the contribution of its own
tokens (the attention PyLayer already returned dK/dV to their owners), and under data
parallelism of its own sequences; the loss was divided by the GLOBAL target count, so the SUM
over cp and dp ranks is exactly the gradient of the global mean loss.

Gradients are summed in buckets: the gradients of consecutive parameters are flattened into one
buffer of at most `bucket_bytes` (never a copy of the whole model), all-reduced once per group,
and written back. A parameter without a gradient on this rank (e.g. an expert no local token
chose) gets zeros first, so every rank's buckets line up — in one process too, so that it is
stepped the same way in every layout (`fill_missing_grads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle

from flashcp.distributed import all_reduce_tensor
from flashcp.optim.layout import group_buckets

BUCKET_BYTES = 64 * 2**20
"""Default gradient bucket size (bytes) for the all-reduce."""


def trainable(model: paddle.nn.Layer) -> list[tuple[str, paddle.Tensor]]:
    """`(structured name, parameter)` of every trainable parameter, in a fixed order."""
    return [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]


def grad_of(p: paddle.Tensor) -> paddle.Tensor | None:
    """The accumulated gradient of `p`: its float32 `main_grad` when hooked
    (`flashcp.optim.trainable.attach_main_grad`), else `.grad`."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def numel(p: paddle.Tensor) -> int:
    """Elements of `p` (1 for a 0-D tensor)."""
    return int(np.prod(p.shape)) if len(p.shape) else 1


def buckets(params: Sequence[paddle.Tensor], bucket_bytes: int) -> list[list[paddle.Tensor]]:
    """Consecutive parameters grouped so each group's gradients fit `bucket_bytes` (float32)."""
    groups = group_buckets([4 * numel(p) for p in params], bucket_bytes)
    return [[params[i] for i in group] for group in groups]


def squared_norm(params: Sequence[paddle.Tensor]) -> float:
    """Sum of squared gradient entries (`grad_of`; float32 per tensor, float64 total), for the
    non-finite check of a rank's own gradients: NaN/Inf propagate. (Not the global norm:
    `flashcp.optim.clip`.)"""
    grads = [grad_of(p) for p in params]
    parts = [paddle.sum(paddle.square(g.astype("float32"))) for g in grads if g is not None]
    if not parts:
        return 0.0
    return float(np.sum(paddle.stack(parts).numpy().astype(np.float64)))


def fill_missing_grads(params: Sequence[paddle.Tensor]) -> None:
    """Zeros as the gradient of every parameter that got none this step (no target reached it:
    a step without targets, an expert no token chose), in EVERY layout: such a parameter is
    stepped like the others (weight decay, moments), exactly as when other ranks' gradients
    are summed into its zeros — so one process and any parallel layout update it alike."""
    for p in params:
        if p.grad is None and not hasattr(p, "main_grad"):
            p.grad = paddle.zeros_like(p)


def sync_grads(
    params: Sequence[paddle.Tensor], groups: Sequence[Any], bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Sum every parameter's gradient over each group in `groups` (in order), in place.

    Groups of one rank are skipped, so single-process training pays nothing.
    """
    fill_missing_grads(params)
    active = [g for g in groups if g is not None and int(g.nranks) > 1]
    if not active:
        return
    for bucket in buckets(params, bucket_bytes):
        flat = paddle.concat([p.grad.astype("float32").reshape([-1]) for p in bucket])
        for group in active:
            all_reduce_tensor(flat, group, inplace=True)
        offset = 0
        for p in bucket:
            n = numel(p)
            p.grad.set_value(flat[offset : offset + n].reshape(list(p.shape)).astype(p.dtype))
            offset += n


def all_reduce_values(values: Sequence[float], groups: Sequence[Any]) -> np.ndarray:
    """Sum a small float64 vector over each group in `groups`; returns numpy."""
    t = paddle.to_tensor(np.asarray(values, dtype=np.float64))
    for group in groups:
        if group is not None and int(group.nranks) > 1:
            t = all_reduce_tensor(t, group)
    return t.numpy()
