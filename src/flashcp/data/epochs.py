"""Epochs: passes over the training data, counted in optimizer steps.

A step consumes `rows_per_step` = micro_batch_size × grad_accum × dp rows (packed sequences,
or DPO rows); one pass over the data is `rows_per_epoch` rows, which the data source counts
at the start (`TrainData.rows_per_epoch`: real tokens / seq_len when packed, the documents
when not; `DPOData.rows_per_epoch`: the first epoch's packed rows). `train.epochs: E` runs
ceil(E × rows_per_epoch / rows_per_step) steps, and a run of N steps makes N × rows_per_step /
rows_per_epoch passes, which the start line shows. `epoch_steps` turns a config's
`train.epochs` into its `train.steps` for the data a run reads.
"""

from __future__ import annotations

import dataclasses
import math

from flashcp.config import Config

TOLERANCE = 1e-9
"""Relative slack before rounding up, so 2 epochs of exactly 10 steps each are 20 steps."""


def steps_for_epochs(epochs: float, rows_per_epoch: float, rows_per_step: int) -> int:
    """Optimizer steps that make `epochs` passes (at least one step)."""
    if rows_per_epoch <= 0 or rows_per_step <= 0:
        raise ValueError(
            f"cannot count steps for train.epochs {epochs}: the data has {rows_per_epoch} rows "
            f"per pass and a step takes {rows_per_step}"
        )
    exact = epochs * rows_per_epoch / rows_per_step
    return max(1, math.ceil(exact * (1.0 - TOLERANCE)))


def passes(steps: int, rows_per_step: int, rows_per_epoch: float) -> float:
    """Passes over the data that `steps` steps make."""
    return steps * rows_per_step / rows_per_epoch if rows_per_epoch > 0 else math.inf


def format_passes(value: float) -> str:
    """`value` passes for the start line: 0.26, 2.3, 12."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def epoch_steps(cfg: Config, data: object) -> Config:
    """`cfg` with `train.steps` counted from `train.epochs` (`cfg` itself when unset) and the
    rows one pass over `data` takes (its `rows_per_epoch`; a data source that does not count
    them is refused, naming it). A step takes micro_batch_size × grad_accum × dp rows."""
    if cfg.train.epochs is None:
        return cfg
    rows = getattr(data, "rows_per_epoch", None)
    if rows is None:
        raise ValueError(
            f"train.epochs is set but the {type(data).__name__} data source does not count its "
            "rows per pass: set train.steps"
        )
    per_step = cfg.data.micro_batch_size * cfg.train.grad_accum * cfg.parallel.dp
    steps = steps_for_epochs(float(cfg.train.epochs), float(rows), per_step)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
