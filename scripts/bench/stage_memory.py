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
from typing import Any

from bench.report import ROOT, render

ENTRY = ROOT / "scripts" / "bench_stage_memory.py"
"""The command line this module runs behind; each build's fresh process runs it again."""


def build(name: str, layers: int, pp: int, stage: int, dtype: str) -> dict[str, Any]:
    """Inside the fresh process: build the stage, return what it cost."""
    import paddle  # here, not at the top: only the fresh build processes load Paddle

    from flashcp.metrics import memory
    from flashcp.models import build_model, preset
    from flashcp.pipeline.stage import stage_spec

    paddle.set_device("cpu")
    args = preset(name, num_layers=layers) if layers else preset(name)
    spec = stage_spec(args, stage, pp) if pp > 1 else None
    before = memory.allocated_bytes()
    memory.reset_peak()
    t = time.perf_counter()
    model = build_model(args, stage=spec, param_dtype=dtype, seed=0, allow_large_on_cpu=True)
    seconds = time.perf_counter() - t
    return {
        "params": sum(int(p.numel()) for p in model.parameters()),
        "held": memory.allocated_bytes() - before,
        "peak": memory.peak_bytes() - before,
        "seconds": seconds,
    }


def measure(name: str, layers: int, pp: int, stage: int, dtype: str) -> dict[str, Any]:
    """One build in a fresh process (allocator peaks are per process)."""
    cmd = [sys.executable, str(ENTRY), "--worker", name, str(layers), str(pp), str(stage), dtype]
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
    parser.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        name, layers, pp, stage, dtype = opts.worker
        print(json.dumps(build(name, int(layers), int(pp), int(stage), dtype)))
        return 0
    rows = []
    start = time.perf_counter()
    for dtype in opts.dtypes:
        rows.append(measure(opts.preset, opts.layers, 1, 0, dtype))
        rows.extend(measure(opts.preset, opts.layers, opts.pp, s, dtype) for s in range(opts.pp))
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(opts.preset, opts.layers, time.perf_counter() - start, rows), end="")
    return 0


def table(preset: str, layers: int, seconds: float, rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, each build against the whole model of its dtype."""
    whole = {r["dtype"]: r for r in rows if r["pp"] == 1}
    return render(
        "stage_memory.md.j2",
        preset=preset,
        layers=layers or "preset",
        seconds=seconds,
        rows=rows,
        whole=whole,
    )
