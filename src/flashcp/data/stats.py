"""`flashcp data-stats`: a config's first steps packed exactly as training packs them, without
training: per step, dp rank and micro-batch the segment lengths of each row, their modelled
work (`flashcp.cp.work`) and the step's imbalance (`flashcp.data.balance`).

One process plans the whole job's rows from the data's lengths (it indexes every row, as the
ranks of a job do together), so the numbers are the ones `balance/...` in metrics.jsonl
reports for the same steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.data.balance import step_report
from flashcp.data.dpo_stream import DPOData
from flashcp.data.loader import TrainData

SHOWN_LENGTHS = 8
"""Segment lengths the text report shows per row (the JSON has them all)."""


def data_stats(data: TrainData | DPOData, steps: int) -> dict[str, Any]:
    """The report of `data`'s first `steps` steps (a recipe's data as dp rank 0 builds it:
    every rank plans the same rows): `{"config", "balance", "balance_window", "seq_len",
    "layout", "steps": [...], "mean": {...}}`, each step as
    `flashcp.data.balance.step_report` gives it."""
    cfg = data.cfg
    out = []
    for step in range(1, steps + 1):
        rows = [data.row_info(r) for r in data.step_rows()]
        out.append(step_report(step, rows, data.layout, data.work, data.seq_len))
    keys = [k for k in out[0] if k.startswith("balance/")] if out else []
    return {
        "config": cfg.source,
        "balance": cfg.data.balance,
        "balance_window": cfg.data.balance_window,
        "seq_len": data.seq_len,
        "layout": {
            "dp": data.layout.dp,
            "grad_accum": data.layout.grad_accum,
            "micro_batch_size": data.layout.micro_batch_size,
        },
        "steps": out,
        "mean": {k: float(np.mean([s[k] for s in out])) for k in keys},
    }


def format_stats(report: dict[str, Any]) -> str:
    """The human-readable report: one block per step, the means last."""
    lay = report["layout"]
    lines = [
        f"{report['config'] or 'config'}: data.balance {report['balance']} (window "
        f"{report['balance_window']} steps), rows of {report['seq_len']} tokens, dp "
        f"{lay['dp']} × grad_accum {lay['grad_accum']} × micro_batch_size "
        f"{lay['micro_batch_size']}; work in model FLOPs"
    ]
    for step in report["steps"]:
        lines.append(
            f"step {step['step']}: dp work max/mean "
            f"{step['balance/dp_work_max_over_mean']:.3f}, micro-batch work max/mean "
            f"{step['balance/microbatch_work_max_over_mean']:.3f}"
        )
        for rank in step["ranks"]:
            for k, micro in enumerate(rank["micro_batches"]):
                lines.append(
                    f"  dp rank {rank['dp_rank']} micro-batch {k}: work {micro['work']:.3e}"
                )
                for row, pad in zip(micro["rows"], micro["padding"], strict=True):
                    shown = ", ".join(str(n) for n in row[:SHOWN_LENGTHS])
                    more = f", ... ({len(row)} segments)" if len(row) > SHOWN_LENGTHS else ""
                    tail = f" + {pad} padding" if pad else ""
                    lines.append(f"    [{shown}{more}]{tail}")
    for key, value in report["mean"].items():
        lines.append(f"mean over {len(report['steps'])} steps: {key} {value:.3f}")
    return "\n".join(lines)
