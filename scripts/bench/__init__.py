"""flashcp's benchmarks and the small library they share.

The library: `rounds` (interleaved rounds: every side once per round, order rotated),
`stats` (median and min–max over rounds, per-round ratios), `machine` (load average around a
measurement, busy cores, CPU model) and `report` (the JSON record, the Markdown page rendered
from it alone through `templates/*.md.j2`, and `--report-only`).

The benchmarks, one module each: `kernel`, `cp` (+ `cp_pages`, `cp_worker`), `moe`
(+ `moe_ep_worker`, its baseline `moe_loop`), `dpo`, `loss_memory`, `tiling_memory`,
`memory_check`, `data` (+ its generated tokenizer `hfdir`), `stage_memory`, `offload_memory`,
`long_context` (plans, not measurements), `balance` (work-balanced packing); `readme_table`
builds the README's "Measured here" table from their JSON. Each runs through a thin entry
script next to this package (`python scripts/bench_dpo.py` runs `bench.dpo`), so the
documented command lines stay.

What the scripts and the tests both judge runs by: `numerics` (the float32 tolerance rule of
every equivalence test and of the golden losses) and `jobs` (`flashcp train` jobs, what makes
one clean, the golden losses; `scripts/update_golden.py`, `scripts/stress_launch.py`).

Tests import these modules by name (`from bench import dpo`: pytest's `pythonpath` holds
`scripts/`), never by file path; nothing here imports from tests/ (the scripts sit below the
tests; see tests/unit/bench/test_lib.py).
"""
