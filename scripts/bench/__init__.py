"""flashcp's benchmarks and the small library they share.

The library: `rounds` (interleaved rounds: every side once per round, order rotated),
`stats` (median and min–max over rounds, per-round ratios), `machine` (load average around a
measurement, busy cores, CPU model) and `report` (the JSON record, the Markdown page rendered
from it alone through `templates/*.md.j2`, and `--report-only`).

The benchmarks, one module each: `kernel`, `cp` (+ `cp_pages`, `cp_worker`), `moe`
(+ `moe_ep_worker`, its baseline `moe_loop`), `dpo`, `loss_memory`, `tiling_memory`,
`memory_check`, `data` (+ its generated tokenizer `hfdir`), `stage_memory`, `offload_memory`,
`long_context` (plans, not measurements); `readme_table` builds the README's "Measured here"
table from their JSON. Each runs through a thin entry script next to this package (`python
scripts/bench_dpo.py` runs `bench.dpo`), so the documented command lines stay; tests import
the modules by name (`from bench import dpo`: pytest's `pythonpath` holds `scripts/`), never by
file path, and nothing here imports from tests/ except through the test harness's launcher
until `flashcp.launch` provides it (see tests/unit/bench/test_lib.py).
"""
