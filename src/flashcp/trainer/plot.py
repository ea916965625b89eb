"""`flashcp plot RUN_DIR`: loss and throughput curves of a run's `metrics.jsonl`, as a PNG; for
an MoE run also the expert load (`moe/max_over_mean_*`, `flashcp.trainer.moe_stats`)."""

from __future__ import annotations

import math
from pathlib import Path

from flashcp.trainer.metrics import read_metrics

MOE_KEYS = ("moe/max_over_mean_max", "moe/max_over_mean_mean")
"""Expert-load ratios drawn in a third panel when the run logged them."""


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `<run_dir>/metrics.png` (or `out`): loss (top) and tokens/s per step, and for an
    MoE run the expert load max/mean (worst layer and mean over layers; 1 = balanced)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no steps yet")
    steps = [int(r["step"]) for r in records]
    loss = [_num(r.get("loss")) for r in records]
    tps = [_num(r.get("tokens_per_s")) for r in records]
    moe = any(MOE_KEYS[0] in r for r in records)
    panels = 3 if moe else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3 * panels), sharex=True)
    ax_loss, ax_tps = axes[0], axes[1]
    ax_loss.plot(steps, loss, color="tab:blue")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{Path(run_dir).name}: {len(records)} steps")
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(steps, tps, color="tab:green")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.grid(alpha=0.3)
    if moe:
        ax_moe = axes[2]
        for key, label in zip(MOE_KEYS, ("worst layer", "mean over layers"), strict=True):
            ax_moe.plot(steps, [_num(r.get(key)) for r in records], label=label)
        ax_moe.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax_moe.set_ylabel("expert load max / mean")
        ax_moe.legend(loc="upper right")
        ax_moe.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    target = Path(out) if out else Path(run_dir) / "metrics.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def _num(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
