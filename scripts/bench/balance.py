"""Work-balanced packing (`data.balance`): modelled imbalance on three length mixes and measured
CPU step times, first-fit (`none`) vs balanced (`work`).

**Modelled** (`--part model`): the planners alone (`flashcp.data.packing.PackedStream` +
`flashcp.data.balance.BalancedPlan`, `flashcp.data.dpo_stream.DPORows`), no model run, on the
seeded mixes of `flashcp.data.mixes` (long-tail documents, short chat, DPO pairs) at
S = 8K, 32K, 128K and dp × grad_accum = 8×1, 8×4, 4×8 (micro_batch_size 1, the default window
of 16 steps), work from GLM-4-9B's widths (`flashcp.cp.work`). Per step the dp work max/mean
(the slowest rank over the mean) and the micro-batch work max/mean; reported: their mean and
p90 over `--model-steps` steps (whole windows), the critical path (each step's slowest rank,
summed) none / work, the FLOPs of the same tokens work / none (balanced packing cuts fewer
documents, so it holds more attention pairs), the attention share, and for LM data the pieces
a document ends up in.

**Measured** (`--part cpu`): `flashcp train` jobs, dp = 2 (2 processes, one thread each),
grad_accum 1, the tiny GPT at `--seq-len` tokens, on a long-tail corpus (the long-tail mix
scaled to the row: lengths × S / 32K, so it reads at S as the mix does at 32K) in a JSON Lines
file; `none` and `work` jobs alternate in `--rounds` interleaved rounds (`bench.rounds`). A job
trains `--steps` steps, a multiple of the window (`--cpu-window`), so both modes train on the
same tokens. Per job: the mean step time over all its steps (the time for those tokens; not a
median over steps: balancing evens the rows within a step and gathers the heaviest documents
into the same steps, so its steps differ more from each other than first-fit's), and the
medians over steps 2..N of `balance/rank_time_max_over_mean` (each rank's forward and
backward time, from the step's count all-reduce to the end of its backward, max over mean)
and of the modelled `balance/dp_work_max_over_mean`. Reported: medians (min–max) over rounds
and the ratios of the medians: mean step time none / work, and modelled FLOPs per second of
step time work / none (the jobs' own plans modelled, as in the first part), with the machine's
load.

Writes `--json` (default docs/balance.json) and `--markdown` (default docs/balance.md), the
page rendered from the JSON alone by `templates/balance.md.j2` (`--report-only` re-renders it).
A run of one part keeps the other part's record from an existing `--json`.

Usage:
    python scripts/bench_balance.py                      # both parts
    python scripts/bench_balance.py --part model         # the modelled tables only
    python scripts/bench_balance.py --report-only        # docs/balance.md from the JSON
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
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine, rounds, stats
from bench.report import DOCS, ROOT, Page
from flashcp.cp.work import WorkModel, causal_pairs, share_question_pairs
from flashcp.data import mixes
from flashcp.data.balance import BalancedPlan, Row, StepLayout, step_balance
from flashcp.data.dpo_stream import DPORows
from flashcp.data.packing import PackedStream, Piece
from flashcp.launch import supervise
from flashcp.models import preset

SEQ_LENS = (8192, 32768, 131072)
LAYOUTS = ((8, 1), (8, 4), (4, 8))
MIXES = ("long_tail", "chat", "dpo")
DP_KEY, MB_KEY = "balance/dp_work_max_over_mean", "balance/microbatch_work_max_over_mean"
TIME_KEY = "balance/rank_time_max_over_mean"
CPU_ACCUM = 1
"""grad_accum of the CPU jobs: 2 dp ranks × 1 micro-batch = 2 rows per step."""
JOB_TIMEOUT = 1800.0
"""Seconds one CPU job may take."""

Record = dict[str, Any]


# -- modelled: the planners on the mixes ------------------------------------------------------


class _Lengths:
    """Documents known by their lengths alone (all a planner reads)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return int(self.lengths.size)


def lm_steps(
    lengths: np.ndarray, seq_len: int, rows: int, steps: int, window: int | None
) -> list[list[list[Piece]]]:
    """`steps` steps of `rows` rows, first-fit (`window` None) or balanced."""
    stream = PackedStream(_Lengths(lengths), seq_len, seed=0)
    if window is None:
        return [[stream.plan_next() for _ in range(rows)] for _ in range(steps)]
    plan = BalancedPlan(stream, rows, window)
    return [plan.next_step() for _ in range(steps)]


def lm_row(pieces: list[Piece]) -> Row:
    """A packed LM row (exactly full) as the work model sees it."""
    lengths = [p.length for p in pieces]
    return Row(tuple(lengths), int(causal_pairs(lengths).sum()))


def attention_share(rows: Sequence[Row], model: WorkModel, seq_len: int) -> float:
    """The attention part of the rows' modelled work."""
    pairs = np.array([r.pairs for r in rows], dtype=np.float64)
    return float(model.attention_per_pair * pairs.sum() / model.flops(seq_len, pairs).sum())


def steps_record(
    planned: Sequence[Sequence[Row]], layout: StepLayout, model: WorkModel, seq_len: int
) -> Record:
    """What planned steps cost: the dp and micro-batch work max/mean (mean and p90 over the
    steps), the attention share, the total FLOPs and the critical path (each step's slowest
    dp rank, summed: what the steps take when FLOPs run at one rate)."""
    per_step = [step_balance(rows, layout, model, seq_len) for rows in planned]
    out: Record = {}
    for key, name in ((DP_KEY, "dp"), (MB_KEY, "microbatch")):
        values = [s[key] for s in per_step]
        out[name] = {"mean": float(np.mean(values)), "p90": float(np.percentile(values, 90))}
    out["attention_share"] = float(np.mean([attention_share(r, model, seq_len) for r in planned]))
    flops = [
        model.flops(seq_len, [r.pairs for r in rows]).reshape(
            layout.grad_accum, layout.dp, layout.micro_batch_size
        )
        for rows in planned
    ]
    out["flops"] = float(sum(f.sum() for f in flops))
    out["critical_flops"] = float(sum(f.sum(axis=(0, 2)).max() for f in flops))
    return out


def compare(record: Record) -> None:
    """Add the modes' ratios to `record`: FLOPs work / none (balanced packing cuts fewer
    documents, so the same tokens hold more attention pairs) and critical path none / work
    (the modelled step-time gain)."""
    none, work = record["none"], record["work"]
    record["flops_work_over_none"] = work["flops"] / none["flops"]
    record["time_none_over_work"] = none["critical_flops"] / work["critical_flops"]


def model_case(
    mix: str, seq_len: int, dp: int, accum: int, steps: int, window: int, model: WorkModel
) -> Record:
    """One (mix, S, layout), none vs work (module docstring)."""
    layout = StepLayout(dp, accum, 1)
    tokens = steps * layout.rows * seq_len
    record: Record = {"mix": mix, "seq_len": seq_len, "dp": dp, "grad_accum": accum}
    start = time.perf_counter()
    for mode, w in (("none", None), ("work", window)):
        if mix == "dpo":
            prompt, chosen, rejected = mixes.dpo(tokens // 1500 + 1000, seq_len)
            plan = DPORows(prompt + chosen + rejected,
                           share_question_pairs(prompt, chosen, rejected), seq_len,
                           rows_per_step=layout.rows, balance_window=w)  # fmt: skip
            planned = [[plan.row_info(r) for r in plan.next_step()] for _ in range(steps)]
        else:
            draw = mixes.long_tail if mix == "long_tail" else mixes.chat
            lengths = draw(tokens // (600 if mix == "chat" else 1500) + 1000)
            pieces = lm_steps(lengths, seq_len, layout.rows, steps, w)
            planned = [[lm_row(r) for r in step] for step in pieces]
            flat = [p for step in pieces for row in step for p in row]
            record.setdefault("pieces_per_document", {})[mode] = len(flat) / len(
                {p.doc for p in flat}
            )
        record[mode] = steps_record(planned, layout, model, seq_len)
    record["plan_seconds"] = time.perf_counter() - start
    compare(record)
    return record


def model_part(steps: int, window: int) -> Record:
    """Every modelled case (module docstring)."""
    model = WorkModel.for_model(preset("glm4_9b"))
    cases = []
    for mix in MIXES:
        for seq_len in SEQ_LENS:
            for dp, accum in LAYOUTS:
                case = model_case(mix, seq_len, dp, accum, steps, window, model)
                cases.append(case)
                print(f"{mix:9s} S={seq_len:6d} {dp}x{accum}: dp work max/mean none "
                      f"{case['none']['dp']['mean']:.3f}, work {case['work']['dp']['mean']:.3f}",
                      flush=True)  # fmt: skip
    return {"model": "glm4_9b", "steps": steps, "window": window, "cases": cases}


# -- measured: dp = 2 CPU jobs -----------------------------------------------------------------


def write_corpus(path: Path, seq_len: int, tokens: int) -> Record:
    """The long-tail mix scaled to `seq_len` as JSON Lines text, at least `tokens` tokens (the
    byte tokenizer: a byte is a token; BOS and EOS make two more)."""
    lengths = np.clip(mixes.long_tail(tokens // 100, seed=7) * seq_len // 32768, 8, None)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    rng = np.random.default_rng(7)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    with path.open("w") as f:
        for n in lengths:
            f.write(json.dumps({"text": rng.choice(letters, size=int(n) - 2).tobytes().decode()}))
            f.write("\n")
    return {
        "documents": int(lengths.size),
        "tokens": int(lengths.sum()),
        "median": float(np.median(lengths)),
        "p99": float(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
    }


def write_config(path: Path, corpus: Path, seq_len: int, steps: int, window: int) -> None:
    """The dp = 2 job (module docstring); `data.balance` comes as an override."""
    path.write_text(
        f"model: {{preset: tiny, max_seq_len: {seq_len}}}\n"
        "parallel: {dp: 2}\n"
        f"data: {{path: {corpus}, seq_len: {seq_len}, micro_batch_size: 1, "
        f"balance_window: {window}}}\n"
        f"train: {{steps: {steps}, grad_accum: {CPU_ACCUM}, warmup_steps: 1, seed: 0}}\n"
        "checkpoint: {every: 0, resume: never}\n"
    )


def run_job(config: Path, balance: str, out: Path) -> Record:
    """One `flashcp train` job (the whole tree stopped after `JOB_TIMEOUT`), read from its
    metrics.jsonl: the mean step time over all steps, the step medians of the balance
    metrics over steps 2..N."""
    cmd = [sys.executable, "-m", "flashcp", "train", str(config), f"data.balance={balance}",
           f"run.output_dir={out}"]  # fmt: skip
    env = supervise.job_env(uuid.uuid4().hex, extra={"OMP_NUM_THREADS": "1"})
    start = time.perf_counter()
    job = supervise.Job.start(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT)  # fmt: skip
    code, timed_out, output = job.wait(JOB_TIMEOUT)
    wall = time.perf_counter() - start
    if code or timed_out:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{(output or '')[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = records[1:]
    return {
        "step_time_s": sum(r["step_time_s"] for r in records) / len(records),
        "step_times_s": [r["step_time_s"] for r in records],
        "rank_time_max_over_mean": stats.median([s[TIME_KEY] for s in steps]),
        "dp_work_max_over_mean": stats.median([s[DP_KEY] for s in steps]),
        "job_wall_s": wall,
    }


def cpu_part(seq_len: int, steps: int, window: int, n_rounds: int) -> Record:
    """The interleaved dp = 2 jobs (module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="flashcp-bench-balance-"))
    corpus, config = work / "corpus.jsonl", work / "balance.yaml"
    rows = 2 * CPU_ACCUM
    info = write_corpus(corpus, seq_len, 3 * steps * rows * seq_len)
    write_config(config, corpus, seq_len, steps, window)
    model = WorkModel.for_model(preset("tiny", max_seq_len=seq_len))
    lengths = np.array([len(json.loads(x)["text"]) + 2 for x in corpus.read_text().splitlines()])
    layout = StepLayout(2, CPU_ACCUM, 1)
    modelled: Record = {}
    for mode, w in (("none", None), ("work", window)):  # the jobs' own plans
        planned = lm_steps(lengths, seq_len, rows, steps, w)
        modelled[mode] = steps_record([[lm_row(r) for r in st] for st in planned], layout, model,
                                      seq_len)  # fmt: skip
        flat = [p for step in planned for row in step for p in row]
        modelled[mode]["pieces_per_document"] = len(flat) / len({p.doc for p in flat})
    compare(modelled)
    jobs: dict[str, list[Record]] = {"none": [], "work": []}
    orders = []
    with machine.load_window() as load:
        for rnd in rounds.interleave(list(jobs), n_rounds):
            orders.append(rnd.order)
            for mode in rnd.order:
                jobs[mode].append(run_job(config, mode, work / f"{mode}{rnd.index}"))
                print(f"round {rnd.index + 1} {mode}: {jobs[mode][-1]}", flush=True)
    step = {m: [j["step_time_s"] for j in v] for m, v in jobs.items()}
    rate = {m: [modelled[m]["flops"] / (j["step_time_s"] * steps) for j in v]
            for m, v in jobs.items()}  # fmt: skip
    return {
        "seq_len": seq_len,
        "steps": steps,
        "window": window,
        "grad_accum": CPU_ACCUM,
        "rounds": n_rounds,
        "orders": orders,
        "corpus": info,
        "modelled": modelled,
        "jobs": jobs,
        "step_time_s": {m: stats.spread(v) for m, v in step.items()},
        "rank_time_max_over_mean": {
            m: stats.spread([j["rank_time_max_over_mean"] for j in v]) for m, v in jobs.items()
        },
        "dp_work_max_over_mean": {
            m: stats.spread([j["dp_work_max_over_mean"] for j in v]) for m, v in jobs.items()
        },
        "flops_per_s": {m: stats.spread(v) for m, v in rate.items()},
        "speedup": stats.ratio_of_medians(step["none"], step["work"]),
        "round_ratios": stats.ratios(step["none"], step["work"]),
        "rate_ratio": stats.ratio_of_medians(rate["work"], rate["none"]),
        "rate_round_ratios": stats.ratios(rate["work"], rate["none"]),
        **load.as_dict(),
    }


# -- the page and the entry point ---------------------------------------------------------------


PAGE = Page("balance.md.j2", DOCS / "balance.json")
"""`docs/balance.md`, from `docs/balance.json` alone."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["model", "cpu", "both"], default="both")
    p.add_argument("--model-steps", type=int, default=48, help="steps per modelled case")
    p.add_argument("--window", type=int, default=16, help="data.balance_window, modelled")
    p.add_argument("--seq-len", type=int, default=8192, help="row length of the CPU jobs")
    p.add_argument("--steps", type=int, default=16, help="steps per CPU job")
    p.add_argument("--cpu-window", type=int, default=8, help="data.balance_window, CPU jobs")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds of CPU jobs")
    PAGE.add_arguments(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return PAGE.rewrite(args)
    if args.steps % args.cpu_window:
        raise SystemExit("--steps must be a multiple of --cpu-window (both modes then train on "
                         "the same tokens)")  # fmt: skip
    json_path = PAGE.paths(args)[0]
    record: Record = PAGE.load(args) if json_path.is_file() else {}
    record["environment"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "omp_num_threads": 1,
        "cpu": machine.cpu_model(),
    }
    if args.part in ("model", "both"):
        record["model"] = model_part(args.model_steps, args.window)
    if args.part in ("cpu", "both"):
        record["cpu"] = cpu_part(args.seq_len, args.steps, args.cpu_window, args.rounds)
    PAGE.write(args, record)
    return 0
