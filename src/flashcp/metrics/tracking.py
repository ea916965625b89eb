"""Tracking backends: where rank 0 reports each step's scalars besides metrics.jsonl.

`run.report_to` lists them: `jsonl` (metrics.jsonl, `flashcp.metrics.writer`, always on),
`visualdl`, `wandb`, `tensorboard`. Each backend is one small class with `log(step, values)`
and `close()` (`flashcp.metrics.writer.Reporter`), registered in `BACKENDS` by name; each
gets the SAME scalars, named as in metrics.jsonl (`metrics.scalars`): loss, lr, grad_norm,
tokens_per_s, mfu (with `hardware.peak_tflops`), consumed_tokens, peak_memory_gib, the
recipe's (`rewards/...` for DPO), `moe/...` when the model reports expert load, and
`eval/...` on the steps that evaluated.

The packages a backend needs (`flashcp.config.REPORT_BACKENDS`) are checked by the config
validation, before anything launches; here they are imported only on rank 0.

* visualdl: `visualdl.LogWriter` in `<output_dir>/visualdl` (`visualdl --logdir ...`);
* tensorboard: `tensorboardX.SummaryWriter` in `<output_dir>/tensorboard`;
* wandb: `wandb.init(project=$WANDB_PROJECT or "flashcp", name=<output_dir name>,
  dir=<output_dir>, config=<the resolved config>)`, then `wandb.log(values, step=step)`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashcp.config import REPORT_BACKENDS, Config, to_dict
from flashcp.metrics.writer import Reporter
from flashcp.rundir import TENSORBOARD_DIR, VISUALDL_DIR


class VisualDLReporter:
    """Scalars to a VisualDL log (`<output_dir>/visualdl`)."""

    def __init__(self, cfg: Config) -> None:
        visualdl = importlib.import_module("visualdl")
        self.logdir = Path(cfg.run.output_dir) / VISUALDL_DIR
        self.writer = visualdl.LogWriter(logdir=str(self.logdir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag=tag, step=step, value=value)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TensorBoardReporter:
    """Scalars to TensorBoard event files (`<output_dir>/tensorboard`, via tensorboardX)."""

    def __init__(self, cfg: Config) -> None:
        tensorboardx = importlib.import_module("tensorboardX")
        self.logdir = Path(cfg.run.output_dir) / TENSORBOARD_DIR
        self.writer = tensorboardx.SummaryWriter(logdir=str(self.logdir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """Scalars to Weights & Biases (project `$WANDB_PROJECT`, default `flashcp`)."""

    def __init__(self, cfg: Config) -> None:
        self.wandb = importlib.import_module("wandb")
        out = Path(cfg.run.output_dir)
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "flashcp"),
            name=out.resolve().name,
            dir=str(out),
            config=to_dict(cfg),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


@dataclass(frozen=True)
class Backend:
    """A `run.report_to` name: how to build its reporter."""

    name: str
    build: Callable[[Config], Reporter] | None
    """None for `jsonl`, which `MetricsWriter` always writes."""


BACKENDS: dict[str, Backend] = {
    "jsonl": Backend("jsonl", None),
    "visualdl": Backend("visualdl", VisualDLReporter),
    "wandb": Backend("wandb", WandbReporter),
    "tensorboard": Backend("tensorboard", TensorBoardReporter),
}
"""Every `run.report_to` name (the same names as `flashcp.config.REPORT_BACKENDS`)."""
assert set(BACKENDS) == set(REPORT_BACKENDS), "tracking backends and config names differ"


def build_reporters(cfg: Config, names: Sequence[str] | None = None) -> list[Reporter]:
    """The reporters of `run.report_to` (or `names`), jsonl excluded; call on rank 0 only."""
    out: list[Reporter] = []
    for name in dict.fromkeys(cfg.run.report_to if names is None else names):
        backend = BACKENDS.get(name)
        if backend is None:
            raise ValueError(f"run.report_to: unknown backend {name!r}: use one of "
                             f"{', '.join(BACKENDS)}")  # fmt: skip
        if backend.build is not None:
            out.append(backend.build(cfg))
    return out


def describe(names: Sequence[str]) -> str:
    """`jsonl, visualdl` for the start line (jsonl always first)."""
    return ", ".join(dict.fromkeys(["jsonl", *names]))
