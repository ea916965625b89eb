"""The learning-rate schedule: linear warmup, then cosine decay to `train.min_lr` (null:
`train.min_lr_ratio` × `train.lr`, `TrainConfig.final_ratio`).

Only the schedule's shape is written here, as the pure function `lr_factor`, so it can be
tested and plotted without Paddle; `build_scheduler` hands it to Paddle's `LambdaDecay`.

For optimizer step i = 0, 1, ... (`train.steps` = N, warmup W = `warmup_steps(train)`): linear
warmup `lr · (i + 1) / W` for i < W (the first step already learns), then cosine from `lr` at
i = W down to `min_lr` at the last step i = N - 1, and `min_lr` after that.

W is `train.warmup_steps` when set. Left null it is `DEFAULT_WARMUP` steps, or a tenth of the run
if that is fewer (`DEFAULT_WARMUP_FRACTION`): a 5-step run warms up for 0 steps and decays over
all 5, where a fixed 10-step warmup would still be warming up when it ends. A warmup you set is
kept even when it leaves no decay (W >= N - 1); `schedule_note` says so for the start line.
"""

from __future__ import annotations

import math

import paddle

from flashcp.config.schema import TrainConfig

DEFAULT_WARMUP = 10
"""Warmup steps when `train.warmup_steps` is null and the run is long enough..."""
DEFAULT_WARMUP_FRACTION = 0.1
"""...else this fraction of `train.steps` (rounded down)."""


def warmup_steps(train: TrainConfig) -> int:
    """The warmup of `train`'s schedule (module docstring)."""
    if train.warmup_steps is not None:
        return int(train.warmup_steps)
    return min(DEFAULT_WARMUP, int(train.steps * DEFAULT_WARMUP_FRACTION))


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) under `train`'s schedule."""
    return train.lr * lr_factor(step, train.steps, warmup_steps(train), train.final_ratio)


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at 0-based `step` (see the module docstring)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = steps - warmup - 1
    if span <= 0:
        return 1.0 if step < steps else min_ratio
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def describe(train: TrainConfig) -> str:
    """The schedule in a few words, for the start line (with `schedule_note` when it has
    one)."""
    w = warmup_steps(train)
    decay = max(train.steps - w, 0)
    text = f"lr {train.lr:g}, warmup {w}, cosine to {train.final_lr:g} over {decay} steps"
    note = schedule_note(train)
    return f"{text} ({note})" if note else text


def schedule_note(train: TrainConfig) -> str | None:
    """What a reader of the start line should know about the schedule's fit: a default warmup
    shortened to fit the run, or a set warmup that leaves no decay (None: neither)."""
    w = warmup_steps(train)
    if train.warmup_steps is None and w < DEFAULT_WARMUP:
        return f"warmup a tenth of the {train.steps} steps; set train.warmup_steps to choose"
    if train.warmup_steps is not None and w >= train.steps - 1:
        return (
            f"train.warmup_steps {w} leaves no decay in {train.steps} steps: the LR only "
            "warms up"
        )
    return None


def build_scheduler(train: TrainConfig) -> paddle.optimizer.lr.LRScheduler:
    """A `LambdaDecay` whose `last_epoch` is the optimizer step about to run."""
    ratio = train.final_ratio
    warmup = warmup_steps(train)

    def factor(step: int) -> float:
        return lr_factor(step, train.steps, warmup, ratio)

    return paddle.optimizer.lr.LambdaDecay(learning_rate=train.lr, lr_lambda=factor)
