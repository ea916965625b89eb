"""Training runs in tests: a config fitted in this process (`fit`: the trainer, what `fit`
returned, what it printed), the losses a run logged, and one config trained two ways for
equivalence tests, in this process or launched.

The tests of the trainer's layouts (`test_train_multiproc.py`, `test_train_pipeline.py`,
`test_dpo_multiproc.py`) train the same config once here (the reference) and once under
`paddle.distributed.launch`, then compare `metrics.jsonl` and the dumped gradients with
`assert_training_matches` (the float32 rule of `bench.numerics`).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import paddle
from safetensors.numpy import load_file

from bench import numerics
from flashcp.checkpoint.checkpointer import GRADS_DIR
from flashcp.config import Config, load_config
from flashcp.metrics.writer import read_metrics
from flashcp.models import build_model
from flashcp.trainer import Trainer
from helpers.launch import run_launch
from helpers.paths import ROOT

TRAIN = ROOT / "src" / "flashcp" / "train.py"


class Fitted(NamedTuple):
    """A config fitted in this process (unpacks as `trainer, result, out`)."""

    trainer: Trainer
    result: Any
    """What `Trainer.fit` returned."""
    out: str
    """What the trainer printed."""

    @property
    def records(self) -> list[dict[str, Any]]:
        """The run's `metrics.jsonl` rows."""
        return read_metrics(self.trainer.cfg.run.output_dir)


def fit(cfg: Config, **trainer_kwargs: Any) -> Fitted:
    """`Trainer(cfg, **trainer_kwargs).fit()` here, its output captured."""
    out = io.StringIO()
    trainer = Trainer(cfg, stream=out, **trainer_kwargs)
    result = trainer.fit()
    return Fitted(trainer, result, out.getvalue())


def losses(run: str | Path | Config) -> list[float]:
    """The loss of every step a run logged, in order; `run` is its directory or its config."""
    directory = run.run.output_dir if isinstance(run, Config) else run
    return [float(r["loss"]) for r in read_metrics(directory)]


def nan_model(cfg: Config, at: int) -> paddle.nn.Layer:
    """The configured model, but its output (final hidden states) becomes NaN on forward call
    `at`: a model factory (`lambda c, s: nan_model(c, at=2)`) for the non-finite paths."""
    model = build_model(cfg.model)
    calls = [0]

    def poison(_layer: Any, _inputs: Any, out: Any) -> Any:
        calls[0] += 1
        return out * float("nan") if calls[0] == at else out

    model.register_forward_post_hook(poison)
    return model


Fit = Callable[..., Fitted]
"""The type of the `fit` fixture."""


def train_in_process(config: Path, out: Path, overrides: Sequence[str]) -> Path:
    """Train `config` with `overrides` here, writing to `out`."""
    Trainer(load_config(config, [*overrides, f"run.output_dir={out}"])).fit()
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


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin")
EXACT = ("targets", "tokens", "examples", "rewards/accuracy")
"""Counts (and the fraction of pairs won, whose margins are far from zero here): exact."""


def load_grads(run: Path, step: int, pp: int = 1) -> dict[str, np.ndarray]:
    """The whole model's summed gradients of `step` (`debug.dump_grads`), stages merged."""
    if pp == 1:
        return load_file(str(run / GRADS_DIR / f"step_{step}.safetensors"))
    out: dict[str, np.ndarray] = {}
    for s in range(pp):
        part = load_file(str(run / GRADS_DIR / f"step_{step}.stage{s}.safetensors"))
        for name, value in part.items():
            if name in out:  # the tied matrix: both copies carry the same summed gradient
                np.testing.assert_array_equal(out[name], value, err_msg=name)
            out[name] = value
    return out


def assert_training_matches(
    run: Path, ref: Path, *, steps: int, pp: int = 1, beta: float | None = None
) -> list[numerics.Comparison]:
    """`run` (another layout) trained like `ref` (one process) under the float32 rule.

    Per step s: the counts exactly; the loss, the gradient norm (and, for DPO — `beta` given
    — the rewards) within `numerics.tolerance(n, scale, steps=s)` with n and scale from the
    reference's metrics (`numerics.metric_basis`); every parameter's gradient norm-wise with
    n = the step's tokens (a weight gradient sums over every token row: positions without a
    target still carry gradient through attention, so a step with 2 targets among 128 tokens
    reduces over 128 rows, not 2). Returns the comparisons (the tests' negative controls feed
    them wrong runs).

    Gradient scale: step 1 measures each tensor against its own norm (the layouts differ only
    in summation order). From step 2 on, the parameters themselves differ by the earlier
    steps' rounding, which AdamW amplifies for near-zero gradients (its first update is
    ~lr·sign(g): a sign that flips moves an element by 2·lr), and that perturbation reaches
    every tensor's gradient in proportion to the whole model's gradient, not to the tensor's
    own — e.g. a LoRA A gradient is proportional to B, ~0 right after init, and carries the
    same absolute error as its neighbours. So from step 2 each tensor's scale is at least the
    RMS of the step's per-tensor gradient norms (‖all grads‖ / √tensors). A wrong shard or
    reduction is off by O(that norm) and stays orders of magnitude outside.
    """
    mine, want = read_metrics(run), read_metrics(ref)
    assert [r["step"] for r in mine] == [r["step"] for r in want] == list(range(1, steps + 1))
    done = []
    for a, b in zip(mine, want, strict=True):
        step = int(b["step"])
        for key in EXACT:
            if key in b:
                assert a[key] == b[key], (key, step, a[key], b[key])
        got, exp = load_grads(run, step, pp), load_grads(ref, step)
        assert set(got) == set(exp) and exp, (step, sorted(set(got) ^ set(exp)))
        if b.get("targets") == 0:  # a step without targets: nothing to learn, exactly
            assert a["loss"] == b["loss"] == 0.0 and a["grad_norm"] == b["grad_norm"] == 0.0
            assert not any(v.any() for v in (*got.values(), *exp.values())), step
            continue
        keys = ("loss", "grad_norm", *(REWARDS if beta is not None else ()))
        for key in keys:
            basis = "grad_norm" if key == "grad_norm" else "loss"
            n, scale = numerics.metric_basis(b, basis, beta=beta)
            what = f"{key} step {step}"
            done.append(
                numerics.assert_close(a[key], b[key], n=n, scale=scale, steps=step, what=what)
            )
        norms = {name: float(np.linalg.norm(v.astype(np.float64))) for name, v in exp.items()}
        rms = math.sqrt(sum(v * v for v in norms.values()) / len(norms))
        for name in exp:
            done.append(
                numerics.assert_close(
                    got[name],
                    exp[name],
                    n=float(max(b["targets"], b.get("tokens", 0))),
                    scale=norms[name] if step == 1 else max(norms[name], rms),
                    steps=step,
                    norm="l2",
                    what=f"grad {name} step {step}",
                )  # fmt: skip
            )
    return done


def merged_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a merged export (`flashcp export --merge-lora`), through its index."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, np.ndarray] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(directory / name)))
    assert set(out) == set(index["weight_map"])
    return out
