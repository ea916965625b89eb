"""AdamW, the warmup + cosine learning-rate schedule, and global-norm gradient clipping.

All three are Paddle's own (`paddle.optimizer.AdamW`, a `paddle.optimizer.lr.LambdaDecay`
scheduler, `paddle.nn.ClipGradByGlobalNorm`); only the schedule's shape is written here, as the
pure function `lr_at`, so it can be tested and plotted without Paddle.

Schedule, for optimizer step i = 0, 1, ... (`train.steps` = N, `train.warmup_steps` = W):
linear warmup `lr · (i + 1) / W` for i < W (the first step already learns), then cosine from
`lr` at i = W down to `min_lr` at the last step i = N - 1, and `min_lr` after that.

Clipping runs inside `optimizer.step()`, after the trainer has summed gradients over the cp and
dp ranks, so the norm it clips is the global one (every rank holds the same summed gradients).
Weight decay applies to matrices and embeddings, not to biases and norm scales (1-D tensors).
"""

from __future__ import annotations

import math
from typing import Any

import paddle

from flashcp.config.schema import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) under `train`'s schedule."""
    return train.lr * lr_factor(step, train.steps, train.warmup_steps, train.min_lr / train.lr)


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at 0-based `step` (see the module docstring)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = steps - warmup - 1
    if span <= 0:
        return 1.0 if step < steps else min_ratio
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(train: TrainConfig) -> paddle.optimizer.lr.LRScheduler:
    """A `LambdaDecay` whose `last_epoch` is the optimizer step about to run."""
    ratio = train.min_lr / train.lr

    def factor(step: int) -> float:
        return lr_factor(step, train.steps, train.warmup_steps, ratio)

    return paddle.optimizer.lr.LambdaDecay(learning_rate=train.lr, lr_lambda=factor)


def decay_parameter_names(model: paddle.nn.Layer) -> set[str]:
    """Paddle names (`param.name`) of the parameters that get weight decay (ndim >= 2)."""
    return {p.name for p in model.parameters() if len(p.shape) >= 2}


def build_optimizer(
    model: paddle.nn.Layer, train: TrainConfig, scheduler: Any, *, clip: Any = None
) -> paddle.optimizer.AdamW:
    """AdamW over `model`'s trainable parameters, clipping by global norm when grad_clip > 0.

    `clip` replaces Paddle's `ClipGradByGlobalNorm(train.grad_clip)` (pipeline stages pass
    `flashcp.optim.clip.PipelineGlobalNormClip`, which clips by the whole model's norm).
    """
    decay = decay_parameter_names(model)
    params = [p for p in model.parameters() if not p.stop_gradient]
    if clip is None and train.grad_clip > 0:
        clip = paddle.nn.ClipGradByGlobalNorm(train.grad_clip)
    return paddle.optimizer.AdamW(
        learning_rate=scheduler,
        parameters=params,
        beta1=train.beta1,
        beta2=train.beta2,
        epsilon=train.eps,
        weight_decay=train.weight_decay,
        apply_decay_param_fun=lambda name: name in decay,
        grad_clip=clip,
    )
