"""Context-parallel benchmarks, in parts: `balance`, `balance_time`, `comm`, `scaling`, `docs`.

* `balance` (computed, model): per-rank attention work under each CP layout. For every mask
  family, cp degree and layout (contiguous, dual-chunk, workload-balanced) it computes each
  rank's work from the mask alone (no processes, no kernels): the number of (128 x 128) tiles
  the FlashMask kernel computes for the rank's local queries against all keys
  (`flashcp.cp.balance.rank_work`, the model the balancer optimises), and reports the
  imbalance max/mean. The workload-balanced layout is swept over `chunks_per_rank`; the
  smallest value reaching the target is reported. Writes `docs/cp_balance.json`.
* `balance_time` (measured): the same layouts in real gloo launches (cp in {2, 4}); every rank
  times its own local FlashMask attention forward + backward (local queries against all keys,
  rebased mask, no communication), the cases interleaved over `--balance-rounds` rounds;
  reports max/mean over ranks of the per-rank median wall (and CPU) time next to the model's
  tile imbalance for the same mask and layout. Writes `docs/cp_balance_time.json`.
* `comm`: bytes each rank sends and receives in one CP attention forward and one backward, in
  real gloo launches (cp in {2, 4}, every CP mode): flashcp's counters (incremented at each
  transfer by the nbytes of the tensors handed to `paddle.distributed`), the same bytes seen
  by a tap around `paddle.distributed.send/recv/all_gather`, and the socket-level bytes
  written, against the theoretical (cp - 1)/cp · 2·B·S·H_kv·D·bytes per direction in the
  forward (K and V all-gathered) and twice that in the backward (K and V re-gathered, dK and
  dV reduce-scattered). Writes `docs/cp_comm.json`.
* `scaling`: CP=2 (2 processes) vs. CP=1 (1 process) attention forward+backward on CPU, one
  thread per process, causal mask; both run `flashmask_attention_cp` (CP=1 on a one-rank cp
  group), alternating launches for `--rounds` rounds; medians after warm-up, per-rank compute
  vs. collective time. Writes `docs/cp_scaling.json`.
* `docs`: no measurement; regenerate the pages from the JSON files.

Every part that writes then regenerates `docs/cp_bench.md` and `docs/cp_balance.md` entirely
from the JSON files in `--out-dir` (`bench.cp_pages`), so no figure on those pages can
disagree with the data.

The launched processes run `scripts/bench_cp_worker.py` through flashcp's supervisor
(`flashcp.launch.supervise.run_launch`: kills the whole job on timeout). Exit codes:
0 ok, 1 a target was missed (balance imbalance, comm bytes ratio outside [0.99, 1.01] or
counters different from the transport, scaling speed-up), 2 an error (bad arguments, a
launch failed).

    python scripts/bench_cp.py --part balance            # S = 16384, cp in {2, 4, 8}: ~30 s
    python scripts/bench_cp.py --part balance_time       # S = 8192, cp in {2, 4}: few min
    python scripts/bench_cp.py --part comm               # S = 8192, cp in {2, 4}: ~1 min
    python scripts/bench_cp.py --part scaling            # S = 8192, CP=2 vs CP=1: ~3 min
    python scripts/bench_cp.py --part docs               # pages from the JSON, no run
    python scripts/bench_cp.py --part comm --quick --comm-cp 2 4 --out-dir /tmp/x   # smoke

Parts are registered in `PARTS` (name -> runner(args) -> exit code), each with its own flags
in `build_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import cp_pages, machine, stats
from bench.cp_pages import (
    BALANCE_JSON,
    BALANCE_TIME_JSON,
    COMM_JSON,
    SCALING_JSON,
    TARGET_FAMILIES,
    UNCONTENDED_SHARE,
    summarize_rounds,
)
from bench.report import DOCS, ROOT, shown
from bench.rounds import interleave
from flashcp.attention.registry import MODES
from flashcp.cp.balance import assign_chunks, balanced_assignment, chunk_work, imbalance, rank_work
from flashcp.cp.layout import Assignment
from flashcp.launch import supervise
from flashcp.mask_families import FAMILIES
from flashcp.masks import Mask, causal_document_mask, share_question_mask

WORKER = ROOT / "scripts" / "bench_cp_worker.py"


# --------------------------------------------------------------------------------------------
# Scenarios: the FlashMask families, plus realistic packings (many documents / DPO examples),
# which the small random FAMILIES generators (1-4 documents per row) do not cover.


def packed_causal_document(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    """SFT packing: documents of log-normal length (median ~ seq_len/16) until the row is full."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lens: list[int] = []
        while sum(lens) < seq_len:
            n = int(np.clip(rng.lognormal(np.log(seq_len / 16), 1.0), 16, seq_len))
            lens.append(min(n, seq_len - sum(lens)))
        rows.append(lens)
    return causal_document_mask(rows, heads=heads)


def packed_share_question(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    """DPO packing: (prompt, chosen, rejected) examples back to back, ~seq_len/8 tokens each."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        examples: list[list[int]] = []
        used = 0
        while True:
            parts = [
                int(np.clip(rng.lognormal(np.log(seq_len / d), 0.6), 8, seq_len))
                for d in (16, 32, 32)
            ]
            if used + sum(parts) > seq_len:
                break
            examples.append(parts)
            used += sum(parts)
        rows.append(share_question_mask(examples, seq_len=seq_len).indices[0])
    return Mask(np.stack(rows).repeat(heads, axis=1).astype(np.int32), causal=True)


SCENARIOS: dict[str, Callable[[int, int, int, int], Mask]] = {
    **FAMILIES,
    "causal_document_packed": packed_causal_document,
    "share_question_packed": packed_share_question,
}


# --------------------------------------------------------------------------------------------
# Part: balance


@dataclass
class BalanceRow:
    """One (scenario, cp, layout) measurement."""

    family: str
    causal: bool
    cp: int
    mode: str
    chunks_per_rank: int
    imbalance: float
    imbalance_pairs: float
    work_per_rank: list[float] = field(default_factory=list)


def layout_for(mode: str, mask: Mask, cp: int, chunks_per_rank: int, block: int) -> Assignment:
    """The assignment a CP job would use for `mode` on this mask."""
    if mode == "contiguous":
        return Assignment.contiguous(cp)
    if mode == "dualchunk":
        return Assignment.dualchunk(cp)
    if mode == "workload_balanced":
        return balanced_assignment(
            mask.indices, causal=mask.causal, world=cp, chunks_per_rank=chunks_per_rank, block=block
        )
    raise ValueError(f"unknown mode {mode!r}")


def measure(family: str, mask: Mask, cp: int, mode: str, k: int, block: int) -> BalanceRow:
    """Per-rank work (tiles, and unmasked pairs for comparison) of one layout."""
    a = layout_for(mode, mask, cp, k, block)
    tiles = rank_work(mask.indices, causal=mask.causal, assignment=a, block=block)
    pairs = rank_work(mask.indices, causal=mask.causal, assignment=a, block=block, unit="pairs")
    return BalanceRow(
        family=family,
        causal=mask.causal,
        cp=cp,
        mode=mode,
        chunks_per_rank=a.chunks_per_rank,
        imbalance=round(imbalance(tiles), 4),
        imbalance_pairs=round(imbalance(pairs), 4),
        work_per_rank=[float(w) for w in tiles],
    )


def ablation(mask: Mask, cp: int, k: int, block: int) -> dict[str, float]:
    """Tile imbalance of the balanced layout vs. two weaker variants of it.

    `lpt_only`: the greedy assignment without the swap search. `by_pairs`: chunks weighed by
    unmasked (row, column) pairs instead of computed tiles (measured in tiles, which is what
    the kernel spends).
    """
    n = cp * k
    tiles = chunk_work(mask.indices, causal=mask.causal, num_chunks=n, block=block)
    pairs = chunk_work(mask.indices, causal=mask.causal, num_chunks=n, block=block, unit="pairs")
    variants = {
        "balanced": assign_chunks(tiles, cp),
        "lpt_only": assign_chunks(tiles, cp, max_rounds=0),
        "by_pairs": assign_chunks(pairs, cp),
    }
    return {
        name: round(
            imbalance(rank_work(mask.indices, causal=mask.causal, assignment=a, block=block)), 4
        )
        for name, a in variants.items()
    }


def run_balance(
    *,
    families: list[str],
    cps: list[int],
    seq_len: int,
    batch: int,
    heads: int,
    seed: int,
    block: int,
    chunks_per_rank: list[int],
    target: float,
) -> dict[str, Any]:
    """All measurements plus, per (family, cp), the smallest chunks_per_rank meeting `target`."""
    rows: list[BalanceRow] = []
    needed: dict[str, dict[str, int | None]] = {}
    ablations: list[dict[str, Any]] = []
    for family in families:
        mask = SCENARIOS[family](batch, seq_len, heads, seed)
        needed[family] = {}
        for cp in cps:
            rows.append(measure(family, mask, cp, "contiguous", 1, block))
            rows.append(measure(family, mask, cp, "dualchunk", 2, block))
            first_ok: int | None = None
            for k in chunks_per_rank:
                if seq_len % (cp * k) or seq_len // (cp * k) < block:
                    continue  # chunks must be whole and at least one tile tall
                row = measure(family, mask, cp, "workload_balanced", k, block)
                rows.append(row)
                if first_ok is None and row.imbalance <= target:
                    first_ok = k
            needed[family][str(cp)] = first_ok
            if family in TARGET_FAMILIES or family == "random_eviction":
                for k in chunks_per_rank[:2]:
                    if seq_len % (cp * k) == 0 and seq_len // (cp * k) >= block:
                        ablations.append(
                            {
                                "family": family,
                                "cp": cp,
                                "chunks_per_rank": k,
                                **ablation(mask, cp, k, block),
                            }
                        )
    return {
        "config": {
            "seq_len": seq_len,
            "batch": batch,
            "heads": heads,
            "seed": seed,
            "block": block,
            "cps": cps,
            "chunks_per_rank": chunks_per_rank,
            "target": target,
            "work_unit": "computed (non-skipped) block x block tiles, summed over batch",
        },
        "rows": [asdict(r) for r in rows],
        "needed_chunks_per_rank": needed,
        "ablation": ablations,
    }


def dumps_compact(result: dict[str, Any]) -> str:
    """JSON with one line per list entry (rows, ablation), for readable diffs."""
    parts = []
    for key, value in result.items():
        if isinstance(value, list):
            items = ",\n".join(f"  {json.dumps(v)}" for v in value)
            parts.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def part_balance(args: argparse.Namespace) -> int:
    """Run the balance part; exit code 1 if a target family misses the target."""
    t0 = time.perf_counter()
    families = args.families or list(SCENARIOS)
    unknown = sorted(set(families) - set(SCENARIOS))
    if unknown:
        print(f"unknown families {unknown}; choose from {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    result = run_balance(
        families=families,
        cps=args.cp,
        seq_len=args.seq_len,
        batch=args.batch,
        heads=args.heads,
        seed=args.seed,
        block=args.block,
        chunks_per_rank=args.chunks_per_rank,
        target=args.target,
    )
    result["config"]["seconds"] = round(time.perf_counter() - t0, 2)
    print(cp_pages.balance_table(result))
    if args.write:
        write_outputs(args.out_dir, BALANCE_JSON, result)
    missed = [
        f"{family} cp={cp}"
        for family in families
        if family in TARGET_FAMILIES
        for cp, k in result["needed_chunks_per_rank"][family].items()
        if k is None
    ]
    if missed:
        print(f"target {args.target} missed for: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# Launching the worker (parts comm and scaling)


@dataclass
class Launched:
    """One finished worker job: its per-rank JSON reports and the machine load around it."""

    nproc: int
    duration: float
    reports: list[dict[str, Any]]
    loadavg_before: list[float]
    loadavg_after: list[float]


THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class LaunchError(RuntimeError):
    """A worker job failed or timed out (the message carries the logs' tails)."""


def launch_worker(
    nproc: int, worker_args: list[str], *, timeout: float, threads: int = 1
) -> Launched:
    """Run `bench_cp_worker.py` on `nproc` processes (gloo), `threads` BLAS/OMP threads each."""
    env = supervise.job_env(uuid.uuid4().hex, extra={name: str(threads) for name in THREAD_ENV})
    with tempfile.TemporaryDirectory(prefix="flashcp-bench-cp-") as tmp:
        out = Path(tmp) / "out"
        with machine.load_window() as load:
            result = supervise.run_launch(
                WORKER,
                nproc,
                [*worker_args, "--out", str(out)],
                timeout=timeout,
                env=env,
                log_dir=Path(tmp) / "logs",
            )
        if not result.ok:
            raise LaunchError(f"worker job on {nproc} process(es) failed:\n{result.summary()}")
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return Launched(nproc, round(result.duration, 2), reports, load.before, load.after)


def problem_args(seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int) -> list[str]:
    """The worker's problem-size flags (float32)."""
    return [
        "--seq-len", str(seq_len), "--batch", str(batch), "--heads", str(heads),
        "--kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--dtype", "float32",
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Part: balance_time (measured per-rank attention time of the balance layouts)

BALANCE_TIME_FAMILIES = ["causal", "causal_document_packed", "share_question_packed"]
BALANCE_LAYOUTS = ["contiguous", "dualchunk", "workload_balanced"]
QUICK_BALANCE_TIME = {"seq_len": 1024, "batch": 1, "heads": 2, "head_dim": 32}


def summarize_balance_job(
    job: Launched, cp: int, *, seq_len: int, batch: int, seed: int, block: int, k: int
) -> list[dict[str, Any]]:
    """Per (family, layout): per-rank medians, max/mean over ranks, and the model's imbalance."""
    reports = sorted(job.reports, key=lambda r: r["rank"])
    rows = []
    for i, case in enumerate(reports[0]["cases"]):
        family, mode = case["family"], case["mode"]
        walls = [r["cases"][i]["wall"] for r in reports]  # [rank][round]
        cpus = [r["cases"][i]["cpu"] for r in reports]
        assert all(r["cases"][i]["family"] == family for r in reports)
        wall_med = [stats.median(w) for w in walls]
        cpu_med = [stats.median(c) for c in cpus]
        per_round = [
            imbalance([w[j] for w in walls]) for j in range(len(walls[0]))
        ]  # same round on every rank: they start together after a barrier
        mask = SCENARIOS[family](batch, seq_len, 1, seed)
        model = measure(family, mask, cp, mode, k, block)
        rows.append(
            {
                "cp": cp,
                "family": family,
                "mode": mode,
                "chunks_per_rank": case["chunks_per_rank"],
                "model_imbalance": model.imbalance,
                "model_work_per_rank": model.work_per_rank,
                "wall_median_per_rank": wall_med,
                "cpu_median_per_rank": cpu_med,
                "imbalance_wall": imbalance(wall_med),
                "imbalance_cpu": imbalance(cpu_med),
                "round_imbalance_wall": per_round,
                "wall_samples": walls,
                "cpu_samples": cpus,
            }
        )
    return rows


def run_balance_time(
    *,
    cps: list[int],
    families: list[str],
    seq_len: int,
    batch: int,
    heads: int,
    head_dim: int,
    seed: int,
    block: int,
    chunks_per_rank: int,
    warmup: int,
    rounds: int,
    timeout: float,
) -> dict[str, Any]:
    """One launch per cp degree; every rank times its local attention for every case."""
    rows: list[dict[str, Any]] = []
    load: list[dict[str, Any]] = []
    for cp in cps:
        job = launch_worker(
            cp,
            ["--task", "balance", "--families", *families, "--layouts", *BALANCE_LAYOUTS,
             "--chunks-per-rank", str(chunks_per_rank), "--block", str(block),
             "--seed", str(seed), "--warmup", str(warmup), "--repeats", str(rounds),
             *problem_args(seq_len, batch, heads, heads, head_dim)],
            timeout=timeout,
        )  # fmt: skip
        load.append({"cp": cp, "before": job.loadavg_before, "after": job.loadavg_after})
        rows += summarize_balance_job(
            job, cp, seq_len=seq_len, batch=batch, seed=seed, block=block, k=chunks_per_rank
        )
        print(f"balance_time cp={cp}: {job.duration:.0f} s", flush=True)
    return {
        "config": {
            "cps": cps,
            "families": families,
            "layouts": BALANCE_LAYOUTS,
            "seq_len": seq_len,
            "batch": batch,
            "heads": heads,
            "head_dim": head_dim,
            "dtype": "float32",
            "seed": seed,
            "block": block,
            "chunks_per_rank": chunks_per_rank,
            "warmup": warmup,
            "rounds": rounds,
            "threads_per_process": 1,
            "cpu_count": os.cpu_count(),
            "timed": "each rank: its local FlashMask attention forward + backward (CPU backend, "
            "local queries vs all keys, rebased mask, no communication), after a barrier",
            "loadavg": load,
        },
        "rows": rows,
    }


def part_balance_time(args: argparse.Namespace) -> int:
    """Run the measured balance part; 2 if a launch fails or a family is unknown."""
    t0 = time.perf_counter()
    unknown = sorted(set(args.balance_families) - set(SCENARIOS))
    if unknown:
        print(f"unknown families {unknown}; choose from {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    size = dict(QUICK_BALANCE_TIME) if args.quick else {
        "seq_len": args.balance_seq_len, "batch": 1, "heads": args.balance_heads,
        "head_dim": args.balance_head_dim,
    }  # fmt: skip
    try:
        result = run_balance_time(
            cps=args.balance_cp,
            families=args.balance_families,
            seed=args.seed,
            block=args.block,
            chunks_per_rank=args.balance_chunks_per_rank,
            warmup=args.warmup,
            rounds=1 if args.quick else args.balance_rounds,
            timeout=args.launch_timeout,
            **size,
        )
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2
    result["config"]["seconds"] = round(time.perf_counter() - t0, 2)
    result["config"]["quick"] = bool(args.quick)
    print(cp_pages.balance_time_table(result))
    if args.write:
        write_outputs(args.out_dir, BALANCE_TIME_JSON, result)
    return 0


def part_docs(args: argparse.Namespace) -> int:
    """Regenerate the pages from the JSON files in --out-dir; no measurement."""
    pages = cp_pages.write_cp_docs(args.out_dir)
    print(f"wrote {', '.join(shown(p) for p in pages)}")
    return 0


# --------------------------------------------------------------------------------------------
# Part: comm

COMM_TOLERANCE = 0.01  # measured/theoretical must lie in [1 - tol, 1 + tol]
QUICK_COMM = {"seq_len": 256, "batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 16}


def theoretical_bytes(
    cp: int, *, seq_len: int, batch: int, kv_heads: int, head_dim: int, itemsize: int = 4
) -> dict[str, float]:
    """Bytes per rank and per direction (sent = received) of one CP attention call.

    Forward: K and V all-gathered, (cp - 1)/cp · 2·B·S·H_kv·D·bytes (every rank sends its
    shard to, and receives one from, each of the cp - 1 others). Backward: K and V re-gathered
    plus dK and dV reduce-scattered, twice the forward.
    """
    forward = (cp - 1) / cp * 2 * batch * seq_len * kv_heads * head_dim * itemsize
    return {"forward": forward, "backward": 2 * forward}


def run_comm(
    *,
    cps: list[int],
    modes: list[str],
    seq_len: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    timeout: float,
) -> dict[str, Any]:
    """Launch one comm job per cp degree; per (cp, mode, rank, direction) bytes and ratios."""
    rows: list[dict[str, Any]] = []
    load: list[dict[str, Any]] = []
    for cp in cps:
        job = launch_worker(
            cp,
            ["--task", "comm", "--modes", *modes,
             *problem_args(seq_len, batch, heads, kv_heads, head_dim)],
            timeout=timeout,
        )  # fmt: skip
        load.append(
            {"cp": cp, "loadavg_before": job.loadavg_before, "loadavg_after": job.loadavg_after}
        )
        theory = theoretical_bytes(
            cp, seq_len=seq_len, batch=batch, kv_heads=kv_heads, head_dim=head_dim
        )
        for report in job.reports:
            for case in report["cases"]:
                for direction in ("forward", "backward"):
                    measured = case[direction]
                    total = measured["counters"]["total"]
                    tap = measured["transport"]
                    wire = measured["syscalls"]
                    rows.append(
                        {
                            "cp": cp,
                            "mode": case["mode"],
                            "rank": report["rank"],
                            "direction": direction,
                            "theoretical": theory[direction],
                            "sent": total["sent"],
                            "received": total["received"],
                            "ratio_sent": total["sent"] / theory[direction],
                            "ratio_received": total["received"] / theory[direction],
                            "transport_sent": tap["sent"],
                            "transport_received": tap["received"],
                            "transport_calls": tap["calls"],
                            "transport_other_calls": tap["other_calls"],
                            "wire_sent": wire["sent"] if wire else None,
                            "ratio_wire_sent": wire["sent"] / theory[direction] if wire else None,
                            "per_op": {
                                op: v for op, v in measured["counters"].items() if op != "total"
                            },
                        }
                    )
    return {
        "config": {
            "seq_len": seq_len,
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": "float32",
            "mask": "causal (global), causal=True",
            "cps": cps,
            "modes": modes,
            "tolerance": COMM_TOLERANCE,
            "theory": "per rank and direction: forward (cp-1)/cp*2*B*S*Hkv*D*4, backward twice",
            "counters": "flashcp comm_stats on the cp group, counted at each transfer from the "
            "tensors handed to paddle.distributed (send/recv of the ring reduce-scatter, "
            "all_gather's input and returned parts)",
            "transport": "TransportTap in the worker: paddle.distributed.send/recv/all_gather "
            "wrapped, nbytes of the tensors they were handed / returned summed",
            "wire": "wchar delta of /proc/self/io (bytes written by write/writev, gloo framing "
            "included); gloo's socket reads are not counted in rchar, so only 'sent' is shown",
            "load": load,
        },
        "rows": rows,
    }


def comm_misses(result: dict[str, Any]) -> list[str]:
    """Rows off the theory by more than the tolerance, or whose counters differ from the tap.

    The counters must equal, byte for byte, what the wrapped `paddle.distributed` calls were
    handed (sent) and returned (received), and no other collective may have run.
    """
    tol = result["config"]["tolerance"]
    misses = []
    for r in result["rows"]:
        where = f"cp={r['cp']} {r['mode']} rank {r['rank']} {r['direction']}"
        if max(abs(r["ratio_sent"] - 1), abs(r["ratio_received"] - 1)) > tol:
            misses.append(
                f"{where}: sent x{r['ratio_sent']:.4f}, received x{r['ratio_received']:.4f}"
            )
        counted = (r["sent"], r["received"])
        tapped = (r["transport_sent"], r["transport_received"])
        if counted != tapped or r["transport_other_calls"]:
            misses.append(
                f"{where}: counters sent/received {counted} but the transport was handed "
                f"{tapped} ({r['transport_other_calls']} untapped collective calls)"
            )
    return misses


def part_comm(args: argparse.Namespace) -> int:
    """Run the comm part; 2 if a launch fails, 1 if a ratio is outside [0.99, 1.01]."""
    if min(args.comm_cp) < 2:
        print("--comm-cp: every cp degree must be >= 2 (cp = 1 sends nothing)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    size = dict(QUICK_COMM) if args.quick else {
        "seq_len": args.comm_seq_len, "batch": args.comm_batch, "heads": args.comm_heads,
        "kv_heads": args.comm_kv_heads, "head_dim": args.comm_head_dim,
    }  # fmt: skip
    try:
        result = run_comm(
            cps=args.comm_cp, modes=args.comm_modes, timeout=args.launch_timeout, **size
        )
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2
    result["config"]["seconds"] = round(time.perf_counter() - t0, 2)
    result["config"]["quick"] = bool(args.quick)
    print(cp_pages.comm_table(result))
    if args.write:
        write_outputs(args.out_dir, COMM_JSON, result)
    missed = comm_misses(result)
    if missed:
        print("bytes off the theory: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


def write_outputs(out_dir: Path, json_name: str, result: dict[str, Any]) -> None:
    """`<out_dir>/<json_name>`, then both pages regenerated from every JSON in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc_json = out_dir / json_name
    doc_json.write_text(dumps_compact(result))
    pages = cp_pages.write_cp_docs(out_dir)
    print(f"\nwrote {shown(doc_json)}, {', '.join(shown(p) for p in pages)}")


# --------------------------------------------------------------------------------------------
# Part: scaling

STEP_KEYS = ("forward", "backward", "total", "cpu")
"""Per-step quantities, each the slowest rank's: wall seconds (forward, backward, both) and
process CPU seconds of forward+backward."""
QUICK_SCALING = {"seq_len": 1024, "batch": 1, "heads": 4, "kv_heads": 4, "head_dim": 32}


def _timed(report: dict[str, Any]) -> list[dict[str, float]]:
    return [it for it in report["timing"]["iterations"] if not it["warmup"]]


def summarize_job(job: Launched) -> dict[str, Any]:
    """Median step times of one launch (step = slowest rank per iteration) and per-rank splits."""
    per_rank = [_timed(r) for r in sorted(job.reports, key=lambda r: r["rank"])]
    steps = {
        key: [max(rank[i][key] for rank in per_rank) for i in range(len(per_rank[0]))]
        for key in STEP_KEYS
    }
    ranks = []
    for report, its in zip(sorted(job.reports, key=lambda r: r["rank"]), per_rank, strict=True):
        comm = [it["comm_forward"] + it["comm_backward"] for it in its]
        window = report["timing"]["window"]
        isolated = report["timing"]["isolated"]
        ranks.append(
            {
                "rank": report["rank"],
                "total": stats.median([it["total"] for it in its]),
                "forward": stats.median([it["forward"] for it in its]),
                "backward": stats.median([it["backward"] for it in its]),
                "comm_forward": stats.median([it["comm_forward"] for it in its]),
                "comm_backward": stats.median([it["comm_backward"] for it in its]),
                "plan": stats.median([it["plan"] for it in its]),
                "compute": stats.median(
                    [it["total"] - c - it["plan"] for it, c in zip(its, comm, strict=True)]
                ),
                "cpu_share": stats.median([it["cpu"] / it["total"] for it in its]),
                "isolated_comm": isolated,
                "busy_cores": window["busy_cores"],
                "window_process_cpu": window["process_cpu"],
                "window_wall": window["wall"],
            }
        )
    ours = sum(r["window_process_cpu"] / r["window_wall"] for r in ranks)
    busy = ranks[0]["busy_cores"]
    return {
        "cp": job.nproc,
        "step": {key: stats.median(v) for key, v in steps.items()},
        "samples": steps,
        "ranks": ranks,
        "machine_busy_cores": busy,
        "own_cores": ours,
        "other_cores": None if busy is None else max(busy - ours, 0.0),
        "loadavg_before": job.loadavg_before,
        "loadavg_after": job.loadavg_after,
        "launch_seconds": job.duration,
    }


def run_scaling(
    *,
    cp: int,
    seq_len: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mode: str,
    warmup: int,
    repeats: int,
    rounds: int,
    timeout: float,
) -> dict[str, Any]:
    """Alternate CP=1 and CP=`cp` launches `rounds` times; medians over every timed iteration."""
    common = [
        "--task", "time", "--modes", mode, "--warmup", str(warmup), "--repeats", str(repeats),
        *problem_args(seq_len, batch, heads, kv_heads, head_dim),
    ]  # fmt: skip
    launches: list[dict[str, Any]] = []
    for rnd in interleave([1, cp], rounds, rotate=False):  # CP=1 first in every round
        for nproc in rnd.order:
            summary = summarize_job(launch_worker(nproc, common, timeout=timeout))
            summary["round"] = rnd.index
            launches.append(summary)
            print(
                f"round {rnd.index} cp={nproc}: fwd+bwd median {summary['step']['total']:.3f} s, "
                f"other load {summary['other_cores']} cores",
                flush=True,
            )

    def pooled(n: int, key: str) -> list[float]:
        """Every timed step of every CP=`n` launch."""
        return [s for x in launches if x["cp"] == n for s in x["samples"][key]]

    base = {k: stats.median(pooled(1, k)) for k in STEP_KEYS}
    par = {k: stats.median(pooled(cp, k)) for k in STEP_KEYS}
    per_round = summarize_rounds(launches, cp)
    clean = [r["speedup"] for r in per_round if r["min_cpu_share"] >= UNCONTENDED_SHARE]
    return {
        "config": {
            "cp": cp,
            "seq_len": seq_len,
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": "float32",
            "mask": "causal (global), causal=True",
            "mode": mode,
            "baseline": "flashmask_attention_cp on a one-rank cp group (1 process)",
            "threads_per_process": 1,
            "warmup": warmup,
            "repeats": repeats,
            "rounds": rounds,
            "step": "wall time of forward+backward on the slowest rank, after a barrier",
            "cpu_count": os.cpu_count(),
        },
        "median": {"cp1": base, f"cp{cp}": par},
        "speedup": {k: stats.ratio_of_medians(pooled(1, k), pooled(cp, k)) for k in STEP_KEYS},
        "uncontended_speedup": stats.median(clean) if clean else None,
        "per_round": per_round,
        "launches": launches,
    }


def part_scaling(args: argparse.Namespace) -> int:
    """Run the scaling part; 2 if a launch fails, 1 if the speed-up misses the target."""
    t0 = time.perf_counter()
    size = dict(QUICK_SCALING) if args.quick else {
        "seq_len": args.scaling_seq_len, "batch": args.scaling_batch,
        "heads": args.scaling_heads, "kv_heads": args.scaling_kv_heads,
        "head_dim": args.scaling_head_dim,
    }  # fmt: skip
    try:
        result = run_scaling(
            cp=args.scaling_cp,
            mode=args.scaling_mode,
            warmup=args.warmup,
            repeats=1 if args.quick else args.repeats,
            rounds=1 if args.quick else args.rounds,
            timeout=args.launch_timeout,
            **size,
        )
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2
    result["config"]["seconds"] = round(time.perf_counter() - t0, 2)
    result["config"]["quick"] = bool(args.quick)
    result["config"]["target"] = args.speedup_target
    print(cp_pages.scaling_table(result, args.speedup_target))
    if args.write:
        write_outputs(args.out_dir, SCALING_JSON, result)
    if result["speedup"]["total"] < args.speedup_target:
        print(
            f"speed-up {result['speedup']['total']:.2f}x below the target "
            f"{args.speedup_target:.2f}x",
            file=sys.stderr,
        )
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# CLI


PARTS: dict[str, Callable[[argparse.Namespace], int]] = {
    "balance": part_balance,
    "balance_time": part_balance_time,
    "comm": part_comm,
    "scaling": part_scaling,
    "docs": part_docs,
}
MEASURING = ("balance", "balance_time", "comm", "scaling")
"""What `--part all` runs."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=[*PARTS, "all"], default="all", help="which benchmark part")
    g = p.add_argument_group("balance")
    g.add_argument("--seq-len", type=int, default=16384)
    g.add_argument("--batch", type=int, default=2, help="sequences per batch (share one layout)")
    g.add_argument("--heads", type=int, default=1, help="mask heads")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block", type=int, default=128, help="kernel tile size (rows = cols)")
    g.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    g.add_argument("--chunks-per-rank", type=int, nargs="+", default=[2, 4, 8, 16])
    g.add_argument("--target", type=float, default=1.05, help="max/mean target for balanced")
    g.add_argument("--families", nargs="*", help=f"subset of {sorted(SCENARIOS)}")
    g = p.add_argument_group("balance_time (launched processes, one thread each)")
    g.add_argument("--balance-cp", type=int, nargs="+", default=[2, 4])
    g.add_argument("--balance-families", nargs="+", default=BALANCE_TIME_FAMILIES)
    g.add_argument("--balance-seq-len", type=int, default=8192)
    g.add_argument("--balance-heads", type=int, default=4, help="query = key/value heads")
    g.add_argument("--balance-head-dim", type=int, default=64)
    g.add_argument("--balance-chunks-per-rank", type=int, default=4, help="workload_balanced k")
    g.add_argument("--balance-rounds", type=int, default=5, help="interleaved timed rounds")
    g = p.add_argument_group("comm (launched processes, gloo)")
    g.add_argument("--comm-cp", type=int, nargs="+", default=[2, 4])
    g.add_argument("--comm-modes", nargs="+", choices=MODES, default=list(MODES))
    g.add_argument("--comm-seq-len", type=int, default=8192)
    g.add_argument("--comm-batch", type=int, default=1)
    g.add_argument("--comm-heads", type=int, default=8)
    g.add_argument("--comm-kv-heads", type=int, default=4)
    g.add_argument("--comm-head-dim", type=int, default=64)
    g = p.add_argument_group("scaling (launched processes, one thread each)")
    g.add_argument("--scaling-cp", type=int, default=2, help="compared with CP=1")
    g.add_argument("--scaling-mode", choices=MODES, default="dualchunk_allgather")
    g.add_argument("--scaling-seq-len", type=int, default=8192)
    g.add_argument("--scaling-batch", type=int, default=1)
    g.add_argument("--scaling-heads", type=int, default=8)
    g.add_argument("--scaling-kv-heads", type=int, default=8)
    g.add_argument("--scaling-head-dim", type=int, default=64)
    g.add_argument("--warmup", type=int, default=1, help="untimed iterations per launch")
    g.add_argument("--repeats", type=int, default=3, help="timed iterations per launch")
    g.add_argument("--rounds", type=int, default=3, help="alternating CP=1 / CP=n launches")
    g.add_argument("--speedup-target", type=float, default=1.7)
    g = p.add_argument_group("all parts")
    g.add_argument("--no-write", dest="write", action="store_false", help="print only")
    g.add_argument("--out-dir", type=Path, default=DOCS, help="where JSON and markdown go")
    g.add_argument(
        "--quick", action="store_true", help="comm/scaling: tiny sizes, one round (smoke)"
    )
    g.add_argument("--launch-timeout", type=float, default=900.0, help="seconds per launch")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = list(MEASURING) if args.part == "all" else [args.part]
    return max(PARTS[name](args) for name in parts)


if __name__ == "__main__":
    sys.exit(main())
