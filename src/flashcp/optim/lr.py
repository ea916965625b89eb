"""The learning-rate schedule: linear warmup, then cosine decay to `train.min_lr` (null:
`train.min_lr_ratio` × `train.lr`, `TrainConfig.final_ratio`).

Only the schedule's shape is written here, as the pure function `lr_factor`, so it can be
tested and plotted without Paddle; `build_scheduler` hands it to Paddle's `LambdaDecay`.

For optimizer step i = 0, 1, ... (`train.steps` = N, `train.warmup_steps` = W): linear warmup
`lr · (i + 1) / W` for i < W (the first step already learns), then cosine from `lr` at i = W
down to `min_lr` at the last step i = N - 1, and `min_lr` after that.
"""

from __future__ import annotations

import math

import paddle

from flashcp.config.schema import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) under `train`'s schedule."""
    return train.lr * lr_factor(step, train.steps, train.warmup_steps, train.final_ratio)


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
    ratio = train.final_ratio

    def factor(step: int) -> float:
        return lr_factor(step, train.steps, train.warmup_steps, ratio)

    return paddle.optimizer.lr.LambdaDecay(learning_rate=train.lr, lr_lambda=factor)
