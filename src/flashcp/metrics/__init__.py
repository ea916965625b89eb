"""What a run reports: per-step metrics, tracking backends, FLOPs/MFU, memory, plots.

* `writer`: the step's log line and `metrics.jsonl`; `tracking`: `run.report_to` backends;
* `flops`: model FLOPs per token and MFU; `memory`: Paddle's allocator statistics;
* `moe_stats`: router loads and the bias update; `plot`: `flashcp plot`;
* `step_sums`: a step's numbers summed over the ranks in one all-reduce;
* `straggler`: a rank whose compute time stays above its stage's median, named;
* `goodput`: `goodput.json`, productive step time over wall time and where the rest went.

`run_info.json` (what each rank built, with the memory plan) is `flashcp.run_info`: it sits
above `flashcp.plan`, which itself uses `flops`.
"""

from flashcp.metrics.writer import METRICS_FILE, MetricsWriter, StepMetrics, read_metrics

__all__ = ["METRICS_FILE", "MetricsWriter", "StepMetrics", "read_metrics"]
