"""The one tolerance rule for float32 results that were computed in a different order.

Why: float32 addition is not associative. Two computations of the same quantity that differ
only in the ORDER of their sums — another process layout (CP shards the sequence, DP and
gradient accumulation split the batch, a pipeline adds two stages' partial gradients), or
another CPU (MKL, OpenBLAS and oneDNN pick their kernels, and so their summation order, by
instruction set; see `docs/portability.md`) — agree only to rounding, and that rounding grows
with the magnitude of the terms summed and with their number. A fixed absolute tolerance holds
on one machine and fails on the next; a fixed relative one on the RESULT misses cancellation
(a DPO reward is the small difference of two large log-prob sums).

The rule: a float32 quantity produced by reducing `n` terms of total magnitude `scale`
(Σ|xᵢ| of the terms; for a mean, the mean of |xᵢ|), compared between two orders, may differ by

    allowed = FACTOR · eps32 · √n · scale · steps

* `eps32 = 2⁻²³` (float32 machine epsilon);
* `√n`: rounding errors of a length-n reduction add like a random walk (Higham & Mary,
  "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019:
  |error| ≤ λ·√n·u·Σ|xᵢ| with high probability; the worst case is n·u);
* `steps`: the number of optimizer steps the quantity has been through (1 = computed from
  identical parameters). A parameter that differs by δ after one step gives the next step's
  results an extra error of about the same relative size, so errors add about linearly over
  the few steps these tests run. AdamW is the worst case: it divides by √v, so a gradient
  element near zero whose rounding differs moves by a whole learning rate — measured drift
  through 4 steps stays below the linear allowance with margin (`docs/portability.md`);
* `FACTOR` (below) = 16: the constant λ, covering both sides of the comparison and the depth
  of the network in front of the last reduction (every layer's matmuls add their own
  rounding). Measured over all 218 `equivalence` tests, with this machine's kernels and with
  another CPU's (`MKL_DEBUG_CPU_TYPE=5 OPENBLAS_CORETYPE=Haswell`, the second pass of
  `scripts/test.sh`): the largest error is 2.85 units (LoRA gradients at step 2, where AdamW
  amplifies near-zero gradients), 5.6× inside the allowance. The negative controls miss it by
  far: a wrong shard or labels shifted after sharding by ≥ 1e5 units in gradients and
  attention outputs, a label shift by 62 units in the golden losses alone
  (`docs/portability.md` has the tables and the one bug 4 golden losses cannot see).

What `n` and `scale` are, per quantity (helpers below): a loss that is a mean over T target
tokens: n = T, scale = the loss; a gradient (compared norm-wise, ‖Δ‖₂): n = T, scale = its
norm; a DPO loss or reward: n = answer tokens per example, scale = β·(|log π(chosen)| +
|log π(rejected)|); attention against the float64 oracle: the tests' `helpers.reference`.

Bitwise equality is claimed only where it holds by construction: the same process layout and
the same order (resume = uninterrupted run, the pipeline without CP, a run repeated). Such tests
say so in their docstrings and compare with `==`.

Set `FLASHCP_NUMERICS_LOG=path` to append every comparison (error, allowance, ratio) to a JSONL
file; `docs/portability.md` quotes such measurements.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)
"""float32 machine epsilon, 2⁻²³ ≈ 1.19e-7."""
FACTOR = 16.0
"""λ of the rule (see the module docstring for why and how it was measured)."""
LOG_ENV = "FLASHCP_NUMERICS_LOG"


def tolerance(n: float, scale: float, *, steps: int = 1, factor: float = FACTOR) -> float:
    """`factor · eps32 · √n · scale · steps`: the allowed difference of two float32 results."""
    if n < 1 or steps < 1 or not math.isfinite(scale) or scale < 0:
        raise ValueError(
            f"tolerance needs n >= 1, steps >= 1, scale >= 0; got {n}, {steps}, {scale}"
        )
    return float(factor * EPS32 * math.sqrt(n) * scale * steps)


@dataclass(frozen=True)
class Comparison:
    """One comparison: the measured error, the allowance, and what it was derived from."""

    what: str
    error: float
    allowed: float
    n: float
    scale: float
    steps: int
    norm: str

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.allowed)

    @property
    def units(self) -> float:
        """The error in units of `eps32 · √n · scale · steps` (the rule allows `FACTOR`)."""
        unit = self.allowed / FACTOR
        return self.error / unit if unit > 0 else (0.0 if self.error == 0 else math.inf)

    def describe(self) -> str:
        return (
            f"{self.what}: {self.norm} error {self.error:.3e} vs allowed {self.allowed:.3e} "
            f"= {FACTOR:g}·eps32·√{self.n:g}·{self.scale:.4g}·{self.steps} "
            f"({self.units:.3g} of {FACTOR:g} units)"
        )


def compare(
    got: Any,
    want: Any,
    *,
    n: float,
    scale: float | None = None,
    steps: int = 1,
    norm: str = "max",
    what: str = "value",
) -> Comparison:
    """Measure `got` against `want` under the rule.

    `norm="max"`: the largest elementwise |got − want|, `scale` defaulting to max |want|;
    `norm="l2"`: ‖got − want‖₂, `scale` defaulting to ‖want‖₂ (gradients: a few near-zero
    elements carry no weight). Infinities must match exactly (the LSE of a fully masked row is
    −inf) and are left out of the norms; NaN anywhere, or different shapes, is an infinite
    error.
    """
    a = np.asarray(got, dtype=np.float64)
    b = np.asarray(want, dtype=np.float64)
    if norm not in ("max", "l2"):
        raise ValueError(f"norm must be 'max' or 'l2', got {norm!r}")
    finite = np.isfinite(b)
    if (
        a.shape != b.shape
        or np.isnan(a).any()
        or np.isnan(b).any()
        or not np.array_equal(a[~finite], b[~finite])  # ±inf (e.g. LSE of a masked row): same
        or not np.isfinite(a[finite]).all()
    ):
        error = math.inf
    elif norm == "max":
        error = float(np.max(np.abs(a[finite] - b[finite]))) if finite.any() else 0.0
    else:
        error = float(np.linalg.norm(a[finite] - b[finite]))
    if scale is None:
        values = b[finite]
        if norm == "max":
            scale = float(np.max(np.abs(values))) if values.size else 0.0
        else:
            scale = float(np.linalg.norm(values))
    result = Comparison(
        what, error, tolerance(n, scale, steps=steps), float(n), float(scale), steps, norm
    )
    _log(result)
    return result


def assert_close(got: Any, want: Any, **kwargs: Any) -> Comparison:
    """`compare(...)` and fail, reporting the error against the allowance, if it is too big."""
    result = compare(got, want, **kwargs)
    if not result.ok:
        raise AssertionError(result.describe())
    return result


def assert_rejects(got: Any, want: Any, *, margin: float = 10.0, **kwargs: Any) -> Comparison:
    """A negative control: `got` (a wrong shard / layout / label) must FAIL the same
    comparison, by at least `margin` × the allowance, so the rule cannot pass a wrong result."""
    result = compare(got, want, what=kwargs.pop("what", "negative control"), **kwargs)
    if not result.error > margin * result.allowed:
        raise AssertionError(
            f"negative control not rejected with margin {margin:g}: {result.describe()}"
        )
    return result


def _log(result: Comparison) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        record = {**asdict(result), "units": result.units, "ok": result.ok, "test": test}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


# -- what n and scale are for the trainer's metrics --------------------------------------------


def metric_basis(
    row: Mapping[str, Any], key: str, *, beta: float | None = None
) -> tuple[float, float]:
    """(n, scale) of metric `key` of one `metrics.jsonl` row (the reference's).

    LM losses: the mean over `targets` tokens of non-negative cross-entropies (n = targets,
    scale = the loss). `grad_norm`: every weight gradient is a sum over the step's token rows
    — all of them, not only the targets: a position without a target still carries gradient
    through attention (n = the row's `tokens` when it has them, at least the targets).
    DPO (`beta` given; the row carries `logps/chosen`, `logps/rejected`): the loss and the
    rewards are β-weighted differences of per-answer log-prob sums over `targets / examples`
    tokens, so their error scales with β·(|log π(chosen)| + |log π(rejected)|), not with
    their own (often near-zero) value.
    """
    targets = max(float(row["targets"]), 1.0)
    if key == "grad_norm":
        return max(targets, float(row.get("tokens", 0))), abs(float(row["grad_norm"]))
    if beta is not None:
        per_example = targets / max(float(row["examples"]), 1.0)
        logps = abs(float(row["logps/chosen"])) + abs(float(row["logps/rejected"]))
        return per_example, beta * logps
    if key != "loss":
        raise KeyError(f"no tolerance basis for metric {key!r}")
    return targets, abs(float(row["loss"]))


# -- a bug model for negative controls -------------------------------------------------------


def labels_shifted_after_sharding(local_ids: np.ndarray, local_labels: np.ndarray) -> np.ndarray:
    """The classic CP bug: next-token labels taken from the LOCAL shard `[B, s]` instead of
    the full sequence — wrong only where a chunk ends inside a document (a few tokens per row;
    the shard's last token wraps to its first), document ends (`-100` in `local_labels`) still
    ignored, so the target count is unchanged. A negative control feeds these labels to the
    same comparison and expects a rejection."""
    wrong = np.roll(np.asarray(local_ids), -1, axis=1)
    wrong[np.asarray(local_labels) == -100] = -100
    return wrong
