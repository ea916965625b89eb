#!/usr/bin/env python
"""Reliability of whole jobs: N consecutive 2- and 4-process `flashcp train` launches.

Launches alternate between the process counts given (default 2 and 4): a 2-process launch
trains `configs/gpt/tiny_cp2.yaml`, a 4-process one `configs/gpt/tiny_cp4.yaml`, each for a few
steps with a checkpoint at the end (so the save barrier and teardown run every time). A launch
is *clean* when `flashcp train` exits 0 within the timeout, every rank reports `exit 0` after
its process-group teardown, no log holds abort/assertion/crash text (upstream's GLM-4.5 job
died with a libuv `uv__finish_close` assertion at shutdown), no process is left behind, and
`metrics.jsonl` has every step. Run directories of clean launches are deleted; failed ones are
kept and their path printed.

    python scripts/stress_launch.py --launches 100           # the README's long run
    python scripts/stress_launch.py --quick                  # CI: 3 launches (2, 4, 2)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import jobs, stats
from flashcp.checkpoint.format import step_dir, verify_checkpoint
from flashcp.rundir import CHECKPOINT_DIR

CONFIG_FOR = {2: "configs/gpt/tiny_cp2.yaml", 4: "configs/gpt/tiny_cp4.yaml"}
QUICK_LAUNCHES = 3


def launch_problems(run: jobs.JobRun, steps: int) -> list[str]:
    """Why one stress launch is not clean (empty when it is)."""
    found = jobs.hygiene_problems(run)
    if not found:
        got = sorted(run.losses())
        if got != list(range(1, steps + 1)):
            found.append(f"metrics.jsonl has steps {got}, expected 1..{steps}")
        problems = verify_checkpoint(step_dir(run.out_dir / CHECKPOINT_DIR, steps))
        if problems:
            found.append(f"checkpoint step_{steps} was not written: {'; '.join(problems)}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20, help="number of launches")
    parser.add_argument(
        "--nproc", type=int, action="append", choices=sorted(CONFIG_FOR), default=None,
        help="process counts to alternate (repeatable; default 2 and 4)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=2, help="train.steps of each launch")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LAUNCHES} launches (CI)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--work-dir", type=Path, default=None, help="where runs are written")
    args = parser.parse_args(argv)

    launches = QUICK_LAUNCHES if args.quick else args.launches
    counts = args.nproc or [2, 4]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="flashcp-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"train.steps={args.steps}",
        f"checkpoint.every={args.steps}",
        "checkpoint.resume=never",
    ]
    print(f"{launches} launches alternating {counts} processes, {args.steps} steps each")
    records: list[dict[str, Any]] = []
    start = time.monotonic()
    for index in range(1, launches + 1):
        nproc = counts[(index - 1) % len(counts)]
        out = work / f"launch_{index:03d}_np{nproc}"
        run = jobs.run_flashcp(CONFIG_FOR[nproc], overrides, out, timeout=args.timeout)
        bad = launch_problems(run, args.steps)
        records.append(
            {"launch": index, "nproc": nproc, "seconds": round(run.duration, 2), "problems": bad}
        )
        status = "clean" if not bad else "FAILED: " + "; ".join(bad)
        print(f"launch {index:3d} ({nproc} proc): {run.duration:5.1f} s  {status}", flush=True)
        if bad:
            print(f"    run kept in {out}", flush=True)
        else:
            shutil.rmtree(out, ignore_errors=True)
    total = time.monotonic() - start
    clean = sum(1 for r in records if not r["problems"])
    by_nproc = {
        n: f"{sum(1 for r in records if r['nproc'] == n and not r['problems'])}/"
        f"{sum(1 for r in records if r['nproc'] == n)}"
        for n in counts
    }
    spread = stats.spread([r["seconds"] for r in records])
    summary = {
        "clean": clean,
        "launches": launches,
        "by_nproc": by_nproc,
        "steps": args.steps,
        "total_seconds": round(total, 1),
        "min_seconds": spread["min"],
        "median_seconds": spread["median"],
        "max_seconds": spread["max"],
        "records": records,
    }
    print(
        f"{clean}/{launches} launches clean ("
        + ", ".join(f"{n} processes: {v}" for n, v in by_nproc.items())
        + f"); {total:.0f} s total, per launch min {summary['min_seconds']:.1f} / median "
        f"{summary['median_seconds']:.1f} / max {summary['max_seconds']:.1f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if clean == launches and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if clean == launches else 1


if __name__ == "__main__":
    sys.exit(main())
