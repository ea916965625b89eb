"""AdamW: the one builder of Paddle's optimizer, and the one map of the names of its state.

`build_adamw` makes every `paddle.optimizer.AdamW` flashcp steps — over the float32
parameters (`flashcp.optim.zero.ParamOptimizer`) and over float32 master shards
(`flashcp.optim.zero.MasterShard`) — from `train`: betas, epsilon, weight decay (on the tensors
named in `decay`: matrices and embeddings, not biases and norm scales, judged by the PARAMETER,
since a master shard is a flat slice of it) and the LR scheduler (`flashcp.optim.lr`). It never
gets a `grad_clip`: the optimizers clip before the step, with the norm they computed once
(`flashcp.optim.clip`).

Paddle keeps AdamW's state in accumulators named `<tensor name>_<accumulator>`
(`linear_3.w_0_moment1_0`). `ACCUMULATORS` maps flashcp's kinds — the tensor names inside an
optimizer shard file — to those accumulator names, and every other spelling of them derives
from it: the unsharded checkpoint form `<structured name>::<accumulator>` (`state_key`,
written by `adamw_arrays`), and reading either saved form back (`load_adamw_state`, through an
`OptimizerSource`; `flashcp.checkpoint.optimizer_state` implements it for the files).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import paddle

from flashcp.config.schema import TrainConfig
from flashcp.optim.grads import numel

MOMENTS = {"moment1": "moment1_0", "moment2": "moment2_0"}
"""Kind → Paddle's accumulator, for the accumulators shaped like their tensor."""
BETA_POWS = {"beta1_pow": "beta1_pow_acc_0", "beta2_pow": "beta2_pow_acc_0"}
"""Kind → Paddle's accumulator, for the powers of the betas (shape [1] per tensor)."""
ACCUMULATORS = {**MOMENTS, **BETA_POWS}
"""Every AdamW accumulator: kind → Paddle's name (the suffix of its state key)."""
SEP = "::"
"""Separates the parameter's structured name from the accumulator in `state_key`."""


def accumulator_name(tensor_name: str, kind: str) -> str:
    """Paddle's state key of accumulator `kind` of the tensor Paddle named `tensor_name`."""
    return f"{tensor_name}_{ACCUMULATORS[kind]}"


def state_key(name: str, kind: str) -> str:
    """The unsharded checkpoint key of accumulator `kind` of parameter `name` (structured)."""
    return f"{name}{SEP}{ACCUMULATORS[kind]}"


def fresh_beta_pows(train: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """Paddle's beta-power accumulators before a tensor's first step."""
    return np.array([train.beta1], np.float32), np.array([train.beta2], np.float32)


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


def adamw_arrays(
    optimizer: paddle.optimizer.AdamW, params: Sequence[tuple[str, paddle.Tensor]]
) -> dict[str, np.ndarray]:
    """The optimizer's state as numpy, keyed `state_key(structured name, kind)`, so it loads
    into a model built again (Paddle names tensors by a process-wide counter)."""
    keys = {
        accumulator_name(p.name, kind): state_key(name, kind)
        for name, p in params
        for kind in ACCUMULATORS
    }
    out = {}
    for key, value in optimizer.state_dict().items():
        if not isinstance(value, paddle.Tensor):
            continue  # LR_Scheduler: saved with the trainer state
        if key not in keys:
            raise ValueError(f"optimizer state {key!r} belongs to no parameter of the model")
        out[keys[key]] = value.numpy()
    return out


def accumulator(state: Mapping[str, Any], tensor: paddle.Tensor, kind: str) -> np.ndarray | None:
    """Accumulator `kind` of `tensor` in `state` (an AdamW `state_dict()`), flattened; None
    before the tensor's first step."""
    value = state.get(accumulator_name(tensor.name, kind))
    return None if value is None else value.numpy().reshape([-1])


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
