"""`flashcp plot RUN_DIR`: every metric group of a run's `metrics.jsonl`, as one PNG.

One panel per group present in the records (`plot_groups`), stacked over a shared step axis:

* loss: the training loss, and `eval/loss` at the steps that evaluated; with trained
  multi-token-prediction layers (`model.mtp_loss_weight`) also its parts, `lm_loss` (the main
  head's) and `mtp_loss` (the MTP depths' mean), and their `eval/` values;
* learning rate; gradient norm;
* throughput: tokens/s, and MFU (%, right axis) when `hardware.peak_tflops` was set;
* memory: peak tensor memory (max over ranks) and peak RSS, GiB;
* dpo: the recipe's `rewards/...` (chosen, rejected, margin, accuracy);
* eval: the other `eval/...` metrics (perplexity, DPO rewards and accuracy);
* moe: every `moe/...` metric (expert load), when the model reports them;
* balance: a step's work over its dp ranks and micro-batches, max / mean, as modelled
  (`balance/dp_work_max_over_mean`, `balance/microbatch_work_max_over_mean`,
  `flashcp.data.balance`) and as the ranks' measured busy time
  (`balance/rank_time_max_over_mean`).

Every panel has a legend naming its lines (also a panel of one line, such as an SFT run's eval
panel, `eval/perplexity`), and evaluations are drawn as points joined by a line, so an eval
that ran once (`eval.every: 0`: after the last step) is a visible point, as is any metric with
a single value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashcp.metrics.writer import read_metrics
from flashcp.rundir import PLOT_FILE

EVAL_COUNTS = ("eval/batches", "eval/rows", "eval/time_s", "eval/targets", "eval/examples")
"""Eval bookkeeping that is not plotted."""
LOSSES = ("loss", "lm_loss", "mtp_loss")
"""The loss panel's metrics (and their `eval/` values): the objective, and with trained MTP
layers its main and MTP parts (`flashcp.recipes.lm`)."""


def _prefixed(prefix: str, skip: tuple[str, ...] = ()) -> Callable[[str], bool]:
    return lambda key: key.startswith(prefix) and key not in skip


def _eval_panel(key: str) -> bool:
    """`eval/...` metrics of the eval panel: not the loss (on the loss panel), not counts, not
    the DPO log-prob sums (hundreds, next to rewards near 0)."""
    return (
        key.startswith("eval/")
        and key not in (*(f"eval/{x}" for x in LOSSES), *EVAL_COUNTS)
        and not key.startswith("eval/logps/")
    )


GROUPS: list[tuple[str, str, Callable[[str], bool]]] = [
    ("loss", "loss", lambda k: k in LOSSES or k.removeprefix("eval/") in LOSSES),
    ("lr", "learning rate", lambda k: k == "lr"),
    ("grad_norm", "gradient norm", lambda k: k == "grad_norm"),
    ("throughput", "tokens / s", lambda k: k in ("tokens_per_s", "mfu")),
    ("memory", "GiB", lambda k: k in ("peak_memory_gib", "peak_rss_gib")),
    ("dpo", "DPO", _prefixed("rewards/")),
    ("eval", "eval", lambda k: _eval_panel(k)),
    ("moe", "MoE", _prefixed("moe/")),
    ("balance", "max / mean", _prefixed("balance/")),
]
"""(group, y-axis label, which metric keys it draws), in panel order."""


def _num(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def plot_groups(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The groups present in `records` (some finite value), each with its metric keys."""
    keys: list[str] = []
    for record in records:
        for key, value in record.items():
            if key not in keys and not isinstance(value, bool) and math.isfinite(_num(value)):
                keys.append(key)
    out: dict[str, list[str]] = {}
    for name, _, member in GROUPS:
        found = [k for k in keys if member(k)]
        if found:
            out[name] = found
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in records if key in r]
    return [int(r["step"]) for r in rows], [_num(r[key]) for r in rows]


def ylabel(name: str, keys: list[str]) -> str:
    """The y-axis label of panel `name` drawing `keys`: the group's label, or for the eval
    panel with one metric (an SFT run's perplexity) that metric's name."""
    if name == "eval" and len(keys) == 1:
        return keys[0].removeprefix("eval/")
    return {group: label for group, label, _ in GROUPS}[name]


def line_style(key: str, points: int) -> str:
    """Points for evaluations and for a series of one value (a line alone would not show it),
    a plain line otherwise."""
    return "o-" if key.startswith("eval/") or points == 1 else "-"


def start_marks(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, label) where a start of the run began other than at its very beginning: a
    resume (``resumed``) and, when the layout changed, from what to what (``resumed: dp 1 × pp
    1 × cp 2 → dp 2 × pp 1 × cp 1``) — throughput jumps there for a reason."""
    marks: list[tuple[int, str]] = []
    layout = None
    for r in records:
        start = r.get("start")
        if not isinstance(start, dict):
            continue
        now = str(start.get("layout", ""))
        if start.get("resumed"):
            label = "resumed" if layout in (None, now) else f"resumed: {layout} → {now}"
            marks.append((int(r["step"]), label))
        layout = now
    return marks


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `<run_dir>/metrics.png` (or `out`): one panel per `plot_groups` group."""
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no steps yet")
    fig = figure(records, Path(run_dir).name)
    target = Path(out) if out else Path(run_dir) / PLOT_FILE
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def figure(records: list[dict[str, Any]], title: str) -> Any:
    """The matplotlib figure of `records`: one panel (axes, in `GROUPS` order) per group
    present, each line labelled with its metric key and named in the panel's legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = plot_groups(records)
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 2.2 * len(groups) + 0.6), sharex=True,
                             squeeze=False)  # fmt: skip
    for ax, (name, keys) in zip(axes[:, 0], groups.items(), strict=True):
        twin = None
        for key in keys:
            steps, values = _series(records, key)
            if key == "mfu":
                twin = ax.twinx()
                twin.plot(steps, [100 * v for v in values], color="tab:red", label="mfu")
                twin.set_ylabel("MFU %")
                continue
            ax.plot(steps, values, line_style(key, len(steps)), label=key, markersize=3)
        ax.set_ylabel(ylabel(name, keys))
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        lines, names = ax.get_legend_handles_labels()
        if twin is not None:
            more, more_names = twin.get_legend_handles_labels()
            lines, names = lines + more, names + more_names
        ax.legend(lines, names, fontsize=7, loc="best")
    for step, label in start_marks(records):  # resumes and layout changes on the step axis
        for ax in axes[:, 0]:
            ax.axvline(step - 0.5, color="0.4", linestyle=":", linewidth=1)
        axes[0, 0].annotate(label, (step - 0.5, 1.0), xycoords=("data", "axes fraction"),
                            fontsize=7, rotation=90, va="top", ha="right")  # fmt: skip
    steps = f"{len(records)} step" + ("" if len(records) == 1 else "s")
    axes[0, 0].figure.suptitle(f"{title}: {steps}", fontsize=10)
    axes[-1, 0].set_xlabel("step")
    for ax in axes[:, 0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # steps, not 0.98
    fig.tight_layout()
    return fig
