"""`flashcp plot RUN_DIR`: loss and throughput curves of a run's `metrics.jsonl`, as a PNG."""

from __future__ import annotations

import math
from pathlib import Path

from flashcp.trainer.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `<run_dir>/metrics.png` (or `out`): loss (top) and tokens/s (bottom) per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no steps yet")
    steps = [int(r["step"]) for r in records]
    loss = [_num(r.get("loss")) for r in records]
    tps = [_num(r.get("tokens_per_s")) for r in records]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, loss, color="tab:blue")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{Path(run_dir).name}: {len(records)} steps")
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(steps, tps, color="tab:green")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
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
