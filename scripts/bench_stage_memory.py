#!/usr/bin/env python
"""What building one pipeline stage costs, from Paddle's allocator: whole model vs each stage,
float32 vs bfloat16 storage.

Each build runs in a fresh process (allocator peaks are per process) and reports the parameters
it materialised, the bytes it holds afterwards, the allocator peak while building (stage-only
construction: the held bytes plus one tensor's float32 init block) and the time. Allocator
counts are exact and deterministic, so one run per row is enough; times are single runs.

    python scripts/bench_stage_memory.py --preset glm4_9b --layers 4 --pp 2
    python scripts/bench_stage_memory.py --preset tiny_glm_moe --pp 3 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

WORKER = """
import json, sys, time
import paddle
paddle.set_device("cpu")
from flashcp.models import build_model, preset
from flashcp.pipeline import stage_spec
from flashcp.trainer import memory
name, dtype = sys.argv[1], sys.argv[5]
layers, pp, stage = (int(x) for x in sys.argv[2:5])
args = preset(name, num_layers=layers) if layers else preset(name)
spec = stage_spec(args, stage, pp) if pp > 1 else None
before = memory.allocated_bytes()
memory.reset_peak()
t = time.perf_counter()
model = build_model(args, stage=spec, param_dtype=dtype, seed=0, allow_large_on_cpu=True)
seconds = time.perf_counter() - t
n = sum(int(p.numel()) for p in model.parameters())
print(json.dumps({"params": n, "held": memory.allocated_bytes() - before,
                  "peak": memory.peak_bytes() - before, "seconds": seconds}))
"""


def measure(name: str, layers: int, pp: int, stage: int, dtype: str) -> dict:
    cmd = [sys.executable, "-c", WORKER, name, str(layers), str(pp), str(stage), dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return {"pp": pp, "stage": stage, "dtype": dtype, **row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny_glm_moe")
    parser.add_argument("--layers", type=int, default=0, help="override num_layers (0: preset)")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    opts = parser.parse_args(argv)
    rows = []
    start = time.perf_counter()
    for dtype in opts.dtypes:
        rows.append(measure(opts.preset, opts.layers, 1, 0, dtype))
        rows.extend(measure(opts.preset, opts.layers, opts.pp, s, dtype) for s in range(opts.pp))
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{opts.preset} layers={opts.layers or 'preset'} ({time.perf_counter() - start:.0f} s)")
    print(
        "| build | dtype | params | held MiB | bytes/param | build peak MiB | share of whole | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        whole = next(r for r in rows if r["pp"] == 1 and r["dtype"] == row["dtype"])
        what = "whole" if row["pp"] == 1 else f"stage {row['stage']}/{row['pp']}"
        print(
            f"| {what} | {row['dtype']} | {row['params']:,} | {row['held'] / 2**20:.1f} | "
            f"{row['held'] / row['params']:.2f} | {row['peak'] / 2**20:.1f} | "
            f"{row['held'] / whole['held']:.3f} | {row['seconds']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
