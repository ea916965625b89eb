"""Per-step metrics: one log line, one JSON object in `metrics.jsonl`, a rank-0 progress bar.

Only rank 0 writes. `metrics.jsonl` is appended one line per step (flushed each time) so a
crash leaves every finished step on disk; a resumed run first drops lines past the checkpoint's
step so the file always reads as one run. `flashcp plot` turns it into a PNG. Every record's
numeric values (`scalars`) also go to the run's tracking backends (`run.report_to`,
`flashcp.metrics.tracking`), under the same names.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from flashcp.rundir import METRICS_FILE

LOGGED_EXTRAS: tuple[str, ...] = ("rewards/margin", "rewards/accuracy", "moe/max_over_mean_max")
"""Recipe metrics that also appear in the human log line (all go to metrics.jsonl)."""
ENV_PROGRESS = "FLASHCP_PROGRESS"
"""`1` forces the progress bar on (e.g. when rank 0's log is streamed to a terminal), `0` off."""


class Reporter(Protocol):
    """A tracking backend (rank 0 only; `flashcp.metrics.tracking` builds them)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass
class StepMetrics:
    """What one optimizer step reports."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    """Tokens processed by the whole job this step (padding included)."""
    targets: int
    """Tokens with a label (what the loss averages over), whole job."""
    tokens_per_s: float
    step_time_s: float
    peak_memory_gib: float
    """Peak bytes of Paddle tensors (allocator statistics, `flashcp.metrics.memory`), GiB: the
    maximum over every rank of each rank's peak since its start."""
    skipped: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    """Recipe metrics (DPO: `rewards/chosen`, `rewards/accuracy`, ...) and, on the steps that
    evaluated, the `eval/...` metrics; written as top-level keys of the JSON record."""
    peak_memory_rank: int = 0
    """The rank holding `peak_memory_gib`."""
    peak_rss_gib: float = 0.0
    """Peak resident set size of the process (everything, not only tensors), max over ranks."""
    consumed_tokens: int = 0
    """Tokens trained on so far by the whole job (cumulative, resumed steps included)."""
    mfu: float | None = None
    """Model FLOPs utilisation (`flashcp.metrics.flops`); None (left out of the record)
    without `hardware.peak_tflops`."""

    def record(self) -> dict[str, Any]:
        """The JSON record: every field (None ones left out), `extra` flattened in."""
        record = asdict(self)
        extra = record.pop("extra")
        record.update(extra)
        return {k: v for k, v in record.items() if v is not None}

    def to_json(self) -> str:
        return json.dumps({k: _finite(v) for k, v in self.record().items()})


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record (booleans and `step` left out): what every
    tracking backend gets, under the same names as in metrics.jsonl."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = float(value)
    return out


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep it readable
    return v


def format_memory(gib: float) -> str:
    """A peak for the log line: GiB from 1 GiB up, MiB below (tiny models stay readable)."""
    return f"{gib:.2f} GiB" if gib >= 1.0 else f"{gib * 1024:.1f} MiB"


def format_line(m: StepMetrics, total_steps: int) -> str:
    """The human log line of a step."""
    width = len(str(total_steps))
    text = (
        f"step {m.step:>{width}}/{total_steps} | loss {m.loss:.4f} | lr {m.lr:.3e} | "
        f"grad_norm {m.grad_norm:.4f} | tok/s {m.tokens_per_s:,.0f} | "
        f"mem {format_memory(m.peak_memory_gib)} (rank {m.peak_memory_rank}) | "
        f"{m.step_time_s:.3f} s"
    )
    if m.mfu is not None:
        text += f" | mfu {100 * m.mfu:.1f}%"
    for key in LOGGED_EXTRAS:
        if key in m.extra:
            text += f" | {key.rsplit('/', 1)[-1]} {m.extra[key]:.4f}"
    return text + (" | SKIPPED (non-finite)" if m.skipped else "")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a `metrics.jsonl` (a run directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} at {p}")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def layout_text(cfg: Any) -> str:
    """A run's layout as a start record names it: ``dp 1 × pp 1 × cp 2 (ep 2)``."""
    par = cfg.parallel
    ep = f" (ep {par.ep})" if getattr(par, "ep", 1) > 1 else ""
    return f"dp {par.dp} × pp {par.pp} × cp {par.cp}{ep}"


class MetricsWriter:
    """Appends `StepMetrics` to `<output_dir>/metrics.jsonl` and prints log lines (rank 0)."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        log_every: int = 1,
        start_step: int = 0,
        stream: TextIO | None = None,
        reporters: Sequence[Reporter] = (),
        start: Mapping[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self._start = dict(start) if start else None
        """Written once, into this start's first record (``"start": {"layout", "resumed"}``):
        `flashcp plot` marks a resume or a layout change on the step axis there."""
        self.reporters = list(reporters) if enabled else []
        """Tracking backends (`flashcp.metrics.tracking`) fed every record's `scalars`."""
        self.total = total_steps
        self.log_every = max(1, log_every)
        self.path = Path(output_dir) / METRICS_FILE
        self.stream = stream or sys.stdout
        self._bar: Any = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self._bar = _progress(total_steps, start_step)

    def _truncate_after(self, step: int) -> None:
        """Keep only records of steps <= `step` (all dropped when starting fresh)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if int(json.loads(line)["step"]) <= step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, m: StepMetrics) -> None:
        """Record one step (JSON every step, a text line every `log_every` steps)."""
        if not self.enabled:
            return
        line = m.to_json()
        if self._start is not None:  # this start's first record: where it began, and how
            line = json.dumps({**json.loads(line), "start": self._start})
            self._start = None
        with open(self.path, "a") as f:
            f.write(line + "\n")
        values = scalars(m.record())
        for reporter in self.reporters:
            reporter.log(m.step, values)
        if m.step % self.log_every == 0 or m.step == self.total or m.skipped:
            self.echo(format_line(m, self.total))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{m.loss:.4f}", refresh=False)

    def echo(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()
        self.reporters = []
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _progress(total: int, start: int) -> Any:
    """A tqdm bar on stderr when it is a terminal (or FLASHCP_PROGRESS=1), else None."""
    flag = os.environ.get(ENV_PROGRESS, "").strip()
    show = flag == "1" or (flag != "0" and sys.stderr.isatty())
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)

