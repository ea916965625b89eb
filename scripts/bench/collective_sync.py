"""What hang detection costs per NCCL collective: the watchdog's task tracking (the default)
against the device drain it replaced (`FLASHCP_SYNC_COLLECTIVES=1`, now the debug mode).

    python scripts/bench_collective_sync.py [--calls 2000] [--rounds 5] [--json OUT]
    python scripts/bench_collective_sync.py --jobs [--config CONFIG] [--steps 6] [--rounds 2]

Host part (any machine): the host time of one watched all-reduce on an NCCL group, with
`paddle.distributed.all_reduce` replaced by a stand-in that returns a completed task at once,
so only flashcp's own wrapper is timed: `bare` (the stand-in alone), `tracked` (the default:
the watchdog armed around the call, the task handed to its thread) and `drain` (debug mode: a
device synchronisation inside the armed block — on a CPU machine a stand-in that returns at
once, so this side measures the Python around it, NOT the drain itself, which on a GPU is the
idle time until every queued kernel has run). Reported per call and scaled to the 6,000
collectives per step of the GLM-4.5-Air EP recipe (issue 21).

Jobs part (`--jobs`): the same `flashcp train` job, default and with FLASHCP_SYNC_COLLECTIVES=1,
in interleaved rounds; the ratio of their median step times (steps after the first). On GPUs
(NCCL) this is the measurement of the drain; on CPU (gloo, never drained) the ratio is ~1: the
control.

Sides run in interleaved rounds (`bench.rounds`); ratios are per round (`bench.stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paddle

from bench import stats
from bench.machine import cpu_model, load_window
from bench.report import write_json
from bench.rounds import interleave
from flashcp.distributed import NamedGroup, collectives
from flashcp.distributed.watchdog import ENV_SYNC, Watchdog
from flashcp.metrics.writer import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JSON = ROOT / "docs" / "collective_sync.json"
AIR_COLLECTIVES_PER_STEP = 6000
"""NCCL collectives per optimizer step of `glm45_air_sft_ep8_pp4_cp8` (issue 21's count)."""


class _PG:
    def name(self) -> str:
        return "NCCL"


class _Done:
    def is_completed(self) -> bool:
        return True


def _host_sides(calls: int) -> dict[str, Callable[[], tuple[float, float]]]:
    """Each side: time `calls` watched all-reduces; (wall, this thread's CPU) seconds per call.
    The CPU time is the robust one on a shared machine: other jobs stretch the wall time."""
    group = NamedGroup("ep", 0, 7, [0, 1], pg=_PG())
    x = paddle.ones([4])
    done = _Done()

    def fake_all_reduce(t: Any, group: Any = None, **_: Any) -> _Done:
        return done

    def run(fn: Callable[[], Any], sync: bool) -> tuple[float, float]:
        os.environ[ENV_SYNC] = "1" if sync else "0"
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls, (time.thread_time() - cpu) / calls

    def bare() -> tuple[float, float]:
        return run(lambda: fake_all_reduce(x, group=group), False)

    def tracked() -> tuple[float, float]:
        return run(lambda: collectives.all_reduce_tensor(x, group, inplace=True), False)

    def drain() -> tuple[float, float]:
        return run(lambda: collectives.all_reduce_tensor(x, group, inplace=True), True)

    collectives.dist.all_reduce = fake_all_reduce  # type: ignore[assignment]
    collectives._drain_device = lambda: None  # the CPU build has no device to drain
    collectives.WATCHDOG = Watchdog(on_expire=print)
    return {"bare": bare, "tracked": tracked, "drain": drain}


def host_part(calls: int, rounds: int) -> dict[str, Any]:
    sides = _host_sides(calls)
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for rnd in interleave(list(sides), rounds, warmup=1):
        for name in rnd.order:
            w, c = sides[name]()
            if rnd.timed:
                wall[name].append(w)
                cpu[name].append(c)
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "us_per_call": {k: stats.spread([1e6 * s for s in v]) for k, v in wall.items()},
        "cpu_us_per_call": {k: stats.spread([1e6 * s for s in v]) for k, v in cpu.items()},
        "tracked_cpu_ms_per_air_step": (
            1e3 * stats.median(cpu["tracked"]) * AIR_COLLECTIVES_PER_STEP
        ),
        "tracked_over_drain_python_cpu": stats.spread(stats.ratios(cpu["tracked"], cpu["drain"])),
    }


def _job(config: str, steps: int, sync: bool, out: Path) -> list[float]:
    """Step times (s) of one `flashcp train` job, steps after the first."""
    env = {**os.environ, ENV_SYNC: "1" if sync else "0", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "flashcp", "train", config, f"train.steps={steps}",
            "checkpoint.every=0", "checkpoint.resume=never", "run.overwrite=true",
            f"run.output_dir={out}"]  # fmt: skip
    subprocess.run(args, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return [float(r["step_time_s"]) for r in read_metrics(out)][1:]


def jobs_part(config: str, steps: int, rounds: int) -> dict[str, Any]:
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="flashcp-sync-bench-") as tmp:
        for rnd in interleave([False, True], rounds):
            for sync in rnd.order:
                run = Path(tmp) / ("drain" if sync else "tracked") / str(rnd.index)
                times[sync].append(stats.median(_job(config, steps, sync, run)))
    return {
        "config": config,
        "steps": steps,
        "step_time_s": {"tracked": stats.spread(times[False]), "drain": stats.spread(times[True])},
        "drain_over_tracked": stats.spread(stats.ratios(times[True], times[False])),
        "device": "gpu" if paddle.is_compiled_with_cuda() else "cpu",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", action="store_true", help="time two flashcp train jobs")
    parser.add_argument("--config", default="configs/glm/tiny_moe_ep2_cp2.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, help=f"write the record here (host part: default "
                        f"{DEFAULT_JSON.relative_to(ROOT)})")  # fmt: skip
    args = parser.parse_args(argv)
    with load_window() as load:
        if args.jobs:
            record = jobs_part(args.config, args.steps, args.rounds)
        else:
            record = host_part(args.calls, args.rounds)
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    record["command"] = f"python scripts/bench_collective_sync.py {argv_text}".strip()
    record["environment"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "paddle": paddle.__version__,
        **load.as_dict(),
    }
    print(json.dumps(record, indent=2))
    out = args.json if args.json is not None or args.jobs else DEFAULT_JSON
    if out is not None:
        write_json(out, record)
    return 0
