"""flashcp's benchmarks and the small library they share.

The library: `rounds` (interleaved rounds: every side once per round, order rotated),
`stats` (median and min–max over rounds, per-round ratios), `machine` (load average around a
measurement, busy cores, CPU model) and `report` (the JSON record, the Markdown page rendered
from it through `templates/*.md.j2`, and `--report-only`).

The benchmarks, one module each, run through thin entry scripts next to this package
(`python scripts/bench_dpo.py` runs `bench.dpo`); tests import them by name (`from bench
import dpo`: pytest's `pythonpath` holds `scripts/`).
"""
