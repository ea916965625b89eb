"""AdamW: the one builder of Paddle's optimizer, and the one map of the names of its state.

`build_adamw` makes every `paddle.optimizer.AdamW` flashcp steps — over the float32 parameters
(`flashcp.optim.param_optimizer.ParamOptimizer`) and over float32 master shards
(`flashcp.optim.master_shard.MasterShard`) — from `train`: betas, epsilon, weight decay (on the
tensors named in `decay`: matrices and embeddings, not biases and norm scales, judged by the
PARAMETER, since a master shard is a flat slice of it) and the LR scheduler
(`flashcp.optim.lr`). It never gets a `grad_clip`: the optimizers clip before the step, with the
norm they computed once (`flashcp.optim.clip`).

Paddle keeps AdamW's state in accumulators named `<tensor name>_<accumulator>`
(`linear_3.w_0_moment1_0`). `ACCUMULATORS` maps flashcp's kinds (`moment1`, `beta1_pow`, ...) to
those accumulator names; nothing else spells them. The state leaves and enters an optimizer in
one layout-neutral form, by parameter (structured name) and element range of the FULL tensor
(an expert-parallel rank's rows are offset by its first expert): `adamw_state` reads it out as
`StatePiece`s, `load_adamw_state` sets it from an `OptimizerSource`. How it is laid out in
files (the unsharded `<name>::<accumulator>` arrays, packed shards) is
`flashcp.checkpoint.optimizer_state`'s alone.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import paddle

from flashcp.config.schema import TrainConfig
from flashcp.device import host_array
from flashcp.optim.grads import numel

MOMENTS = {"moment1": "moment1_0", "moment2": "moment2_0"}
"""Kind → Paddle's accumulator, for the accumulators shaped like their tensor."""
BETA_POWS = {"beta1_pow": "beta1_pow_acc_0", "beta2_pow": "beta2_pow_acc_0"}
"""Kind → Paddle's accumulator, for the powers of the betas (shape [1] per tensor)."""
ACCUMULATORS = {**MOMENTS, **BETA_POWS}
"""Every AdamW accumulator: kind → Paddle's name (the suffix of its state key)."""


def accumulator_name(tensor_name: str, kind: str) -> str:
    """Paddle's state key of accumulator `kind` of the tensor Paddle named `tensor_name`."""
    return f"{tensor_name}_{ACCUMULATORS[kind]}"


def fresh_state(train: TrainConfig, length: int) -> dict[str, np.ndarray]:
    """Paddle's AdamW state of a tensor of `length` elements before its first step, by kind:
    zero moments (flat), beta powers at the betas (shape [1])."""
    betas = dict(zip(BETA_POWS, (train.beta1, train.beta2), strict=True))
    return {
        **{kind: np.zeros(length, np.float32) for kind in MOMENTS},
        **{kind: np.array([beta], np.float32) for kind, beta in betas.items()},
    }


def decay_names(tensors: Iterable[paddle.Tensor]) -> set[str]:
    """Paddle names of the tensors that get weight decay: matrices and embeddings (ndim >= 2)."""
    return {t.name for t in tensors if len(t.shape) >= 2}


def build_adamw(
    tensors: Sequence[paddle.Tensor], train: TrainConfig, scheduler: Any, decay: Collection[str]
) -> paddle.optimizer.AdamW:
    """Paddle's AdamW over `tensors` with `train`'s betas, epsilon and weight decay (on the
    tensors Paddle names in `decay`); `scheduler`: an LR scheduler or a fixed LR."""
    return paddle.optimizer.AdamW(
        learning_rate=scheduler,
        parameters=list(tensors),
        beta1=train.beta1,
        beta2=train.beta2,
        epsilon=train.eps,
        weight_decay=train.weight_decay,
        apply_decay_param_fun=lambda name: name in decay,
    )


@dataclass(frozen=True)
class StatePiece:
    """The optimizer state of one tensor an AdamW steps: elements `[start, start + length)` of
    flattened parameter `name` (structured; full-tensor coordinates, as `OptimizerSource.read`
    takes them), by kind: `"master"` (float32 master weights, when the optimizer keeps them)
    and the kinds of `ACCUMULATORS` Paddle holds so far (none before the tensor's first step).
    Moments are shaped like the stepped tensor, beta powers `[1]`."""

    name: str
    start: int
    length: int
    arrays: dict[str, np.ndarray]


def adamw_state(
    optimizer: paddle.optimizer.AdamW, tensors: Iterable[tuple[paddle.Tensor, str, int]]
) -> list[StatePiece]:
    """`optimizer`'s state as numpy, one piece per `(tensor, name, start)`: the tensor stepped
    by `optimizer` holds elements `[start, start + numel)` of parameter `name` (flattened).
    Keyed by structured name, so it loads into a model built again (Paddle names tensors by a
    process-wide counter)."""
    state = optimizer.state_dict()
    out = []
    for tensor, name, start in tensors:
        arrays = {}
        for kind in ACCUMULATORS:
            value = state.get(accumulator_name(tensor.name, kind))
            if value is not None:
                arrays[kind] = host_array(value)
        out.append(StatePiece(name, start, numel(tensor), arrays))
    return out


class OptimizerSource(Protocol):
    """Saved optimizer state, read by parameter (structured name) and element range."""

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        """Elements `[start, start + length)` of the flattened `kind` ("master", or a kind of
        `MOMENTS`) of parameter `name`, float32; None when the checkpoint has none."""
        ...

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The parameter's beta-power accumulators, in `BETA_POWS` order, or None."""
        ...


def load_adamw_state(
    optimizer: paddle.optimizer.AdamW,
    tensors: Iterable[tuple[paddle.Tensor, str, int]],
    source: OptimizerSource,
) -> None:
    """Set `optimizer`'s state from `source`: for each `(tensor, name, start)`, the tensor
    stepped by `optimizer` holds elements `[start, start + numel)` of saved parameter `name`
    (flattened). A tensor without any saved state starts fresh, as Paddle's AdamW would."""
    state: dict[str, paddle.Tensor] = {}
    for tensor, name, start in tensors:
        moments = {kind: source.read(name, kind, start, numel(tensor)) for kind in MOMENTS}
        pows = source.beta_pows(name)
        found = [v is not None for v in (*moments.values(), pows)]
        if not any(found):
            continue
        if not all(found):
            raise ValueError(
                f"the checkpoint's optimizer state of {name!r} is incomplete (moments or "
                "beta powers missing): was it written by another flashcp version?"
            )
        assert pows is not None
        shape = list(tensor.shape)
        for kind, value in moments.items():
            assert value is not None
            state[accumulator_name(tensor.name, kind)] = paddle.to_tensor(value.reshape(shape))
        for kind, value in zip(BETA_POWS, pows, strict=True):
            state[accumulator_name(tensor.name, kind)] = paddle.to_tensor(value.reshape([1]))
    if state:
        optimizer.set_state_dict(state)
