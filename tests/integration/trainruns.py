"""Run one training config two ways for equivalence tests: in this process, or launched.

Both tests of the trainer's layouts (`test_train_pipeline.py`, `test_dpo_multiproc.py`) train
the same config once here (the reference) and once under `paddle.distributed.launch`, then
compare `metrics.jsonl` and the dumped gradients.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from launch import run_launch

from flashcp import dispatch
from flashcp.config import load_config
from flashcp.trainer import Trainer

TRAIN = Path(__file__).resolve().parents[2] / "src" / "flashcp" / "train.py"
# Flags the trainer's deterministic mode exports; restored after an in-process run.
FLAGS = (dispatch.FLAG_DETERMINISTIC, "FLAGS_embedding_deterministic")


def train_in_process(config: Path, out: Path, overrides: Sequence[str]) -> Path:
    """Train `config` with `overrides` here, writing to `out`; restores the flags it sets."""
    cfg = load_config(config, [*overrides, f"run.output_dir={out}"])
    saved = {k: os.environ.get(k) for k in FLAGS}
    try:
        Trainer(cfg).fit()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out


def train_launched(config: Path, out: Path, nproc: int, overrides: Sequence[str]) -> Path:
    """`python -m paddle.distributed.launch --nproc_per_node N src/flashcp/train.py ...`."""
    result = run_launch(
        TRAIN,
        nproc,
        ["--config", str(config), *overrides, f"run.output_dir={out}"],
        timeout=150,
        log_dir=out.parent / f"{out.name}_logs",
    )
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    return out
