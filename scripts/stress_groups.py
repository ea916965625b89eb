#!/usr/bin/env python
"""Reliability check of flashcp's process groups: N consecutive multi-process launches.

Each launch starts `--nproc` CPU workers (gloo) via `paddle.distributed.launch`; every worker
builds the groups of every dp × pp × cp factorisation of the world size (e.g. 1x2x2, 2x1x2, ...
for 4), runs an all_reduce and a ring reduce-scatter on each group, and shuts down. A launch is
*clean* when the job exits 0 within the timeout, every rank printed `WORKER DONE`, no rank log
shows a traceback or assertion, and no job process is left behind.

    python scripts/stress_groups.py --launches 20 --nproc 4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench import jobs, stats
from flashcp.launch import supervise
from flashcp.launch.supervise import LaunchResult

WORKER = Path(__file__).resolve().parent / "stress_groups_worker.py"
BAD_LOG = re.compile(r"Traceback|Assertion|assert(ion)? failed|core dumped|Segmentation", re.I)


def factorisations(world: int) -> list[str]:
    """Every `DPxPPxCP` with dp * pp * cp == world."""
    out = []
    for dp in range(1, world + 1):
        for pp in range(1, world + 1):
            if world % (dp * pp) == 0:
                out.append(f"{dp}x{pp}x{world // (dp * pp)}")
    return out


def problems(result: LaunchResult, nproc: int) -> list[str]:
    """Why a launch is not clean (empty when it is)."""
    found = []
    if result.timed_out:
        found.append(f"timed out after {result.duration:.0f} s")
    elif result.returncode != 0:
        found.append(f"exit code {result.returncode}")
    if result.leftover:
        found.append(f"left processes behind: {result.leftover}")
    for rank in range(nproc):
        log = result.log(rank)
        if "WORKER DONE" not in log:
            found.append(f"rank {rank} did not finish")
        match = BAD_LOG.search(log)
        if match:
            found.append(f"rank {rank} log contains {match.group(0)!r}")
    return found


def launch(nproc: int, worker_args: list[str], timeout: float) -> LaunchResult:
    """One launch of the worker through flashcp's supervisor: the whole job marked (killed if it
    outlives `timeout`), one thread per process, its logs in a fresh directory."""
    marker = uuid.uuid4().hex
    return supervise.run_launch(
        WORKER, nproc, worker_args,
        log_dir=Path(tempfile.mkdtemp(prefix="flashcp-stress-groups-")),
        timeout=timeout,
        env=jobs.launch_env(marker),
        marker_env=jobs.MARKER_ENV,
        launcher_args=["--job_id", f"flashcp-{marker[:8]}"],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    parser.add_argument(
        "--topology", action="append", default=None,
        help="DPxPPxCP to build (repeatable); default: every factorisation of --nproc",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)

    topologies = args.topology or factorisations(args.nproc)
    worker_args = [a for t in topologies for a in ("--topology", t)]
    print(f"{args.launches} launches x {args.nproc} processes, topologies {topologies}")
    records = []
    start = time.monotonic()
    for index in range(1, args.launches + 1):
        result = launch(args.nproc, worker_args, args.timeout)
        bad = problems(result, args.nproc)
        records.append({"launch": index, "seconds": round(result.duration, 2), "problems": bad})
        status = "clean" if not bad else "FAILED: " + "; ".join(bad)
        print(f"launch {index:3d}: {result.duration:5.1f} s  {status}", flush=True)
        if bad:
            print(f"    logs: {result.log_dir}", flush=True)
    total = time.monotonic() - start
    clean = sum(1 for r in records if not r["problems"])
    spread = stats.spread([r["seconds"] for r in records])
    summary = {
        "clean": clean,
        "launches": args.launches,
        "nproc": args.nproc,
        "topologies": topologies,
        "total_seconds": round(total, 1),
        "min_seconds": spread["min"],
        "median_seconds": spread["median"],
        "max_seconds": spread["max"],
        "records": records,
    }
    print(
        f"{clean}/{args.launches} launches clean; {total:.0f} s total, per launch "
        f"min {summary['min_seconds']:.1f} / median {summary['median_seconds']:.1f} / "
        f"max {summary['max_seconds']:.1f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if clean == args.launches else 1


if __name__ == "__main__":
    sys.exit(main())
