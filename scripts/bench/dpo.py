"""DPO training throughput: share-question packing vs the unpacked baseline, in one run.

Both layouts train on the SAME examples (the built-in preference set, repeated `--repeat`
times, tokenized with the byte tokenizer and truncated once so both layouts hold identical
tokens) with the SAME model (built from one seed; the reference is a frozen copy) and the same
DPO step: reference forward (no gradients), policy forward, sigmoid DPO loss averaged over the
batch's pairs, backward, AdamW step.

* packed: `pack_dpo_batches`: per row several pairs, each as the prompt once followed by both
  answers, positions restarting for each answer, share-question FlashMask (`--seq-len` tokens,
  `--rows` rows per step);
* unpacked: `unpack_dpo(..., paired=True)`: per answer one causal sequence `prompt + answer`
  (the prompt repeated for chosen and rejected), padded to the smallest `--buckets` length that
  holds the longer answer of its pair, `--unpacked-rows` sequences per step (both answers of a
  pair in the same batch).

Throughput = example tokens / second, where example tokens = len(prompt) + len(chosen) +
len(rejected) summed over the pairs trained on: the same count for both layouts, so the ratio
is the inverse ratio of the time one pass over the examples takes. Also reported: positions
computed per second (rows × row length, padding and repeated prompts included) and how many
of those positions carry example tokens.

Both layouts cover the same answers, checked before anything is timed: every (pair, answer)
appears exactly once in each layout, with the identical label tokens (so the same answer token
counts); the script stops with an error otherwise. As a second check that both see the same
examples and model, the initial reference log-probs of every answer are compared between the
layouts (they must agree to float rounding).

Interleaved: each layout runs one untimed warm-up pass, then `--epochs` timed passes ALTERNATE
between the layouts (packed, unpacked, then unpacked, packed, ...), so slow periods of a shared
machine hit both. Reported: per layout the median (min–max) pass time, and the speed-up as the
median (min–max) of the per-epoch ratios unpacked / packed of passes run back to back. The
machine's load average before and after is recorded.

Writes `--json` (default docs/bench_dpo.json) and `--markdown` (default docs/bench_dpo.md), the
page generated from the JSON alone (`--report-only` regenerates it).

Usage:
    python scripts/bench_dpo.py                      # default: small_glm, 512-token rows
    python scripts/bench_dpo.py --preset tiny_glm --seq-len 256 --json /tmp/b.json   # smoke
    python scripts/bench_dpo.py --report-only        # rewrite docs/bench_dpo.md from the JSON
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench import machine, rounds, stats
from bench.report import DOCS, Page


@dataclass
class LayoutResult:
    """One layout's measurements."""

    name: str
    batches: int
    rows: int
    row_lengths: list[int]
    positions: int
    real_positions: int
    pass_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return stats.median(self.pass_seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small_glm", help="model preset (default small_glm)")
    p.add_argument("--seq-len", type=int, default=512, help="packed row length")
    p.add_argument("--rows", type=int, default=1, help="packed rows per step")
    p.add_argument("--buckets", default="64,128,192,256,384,512", help="unpacked lengths")
    p.add_argument("--unpacked-rows", type=int, default=8, help="unpacked sequences per step")
    p.add_argument("--repeat", type=int, default=1, help="passes of the built-in set per epoch")
    p.add_argument("--epochs", type=int, default=3, help="timed passes per layout (interleaved)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="OMP threads (default: as set)")
    PAGE.add_arguments(p)
    return p.parse_args(argv)


def build_examples(args: argparse.Namespace) -> list[Any]:
    from flashcp.data.dpo_records import DPORecords, fit_examples
    from flashcp.data.sources import BUILTIN_PREFERENCES, read_records
    from flashcp.data.tokenizer import ByteTokenizer

    records = read_records(BUILTIN_PREFERENCES) * args.repeat
    build = DPORecords(ByteTokenizer(), budget=1 << 30)  # untruncated: truncated below
    examples = [build.tokenize(r) for r in records]
    top = max(int(b) for b in args.buckets.split(","))
    # truncate once for the tighter of the two budgets, then both layouts get these tokens
    examples = fit_examples(examples, top, layout="unpacked", truncation="truncate")
    return fit_examples(examples, args.seq_len, layout="packed", truncation="truncate")


def layouts(args: argparse.Namespace, examples: list[Any]) -> dict[str, list[Any]]:
    from flashcp.data.dpo_packing import pack_dpo_batches, unpack_dpo
    from flashcp.data.tokenizer import ByteTokenizer

    pad = ByteTokenizer().pad_id
    buckets = [int(b) for b in args.buckets.split(",")]
    packed = list(pack_dpo_batches(examples, args.seq_len, args.rows, pad_id=pad))
    unpacked = unpack_dpo(
        examples, buckets, pad_id=pad, rows_per_batch=args.unpacked_rows, paired=True
    )
    return {"packed": packed, "unpacked": unpacked}


def example_tokens(examples: Sequence[Any]) -> int:
    return sum(len(e.prompt) + len(e.chosen) + len(e.rejected) for e in examples)


def answer_coverage(batches: Sequence[Any]) -> dict[tuple[int, int], tuple[int, ...]]:
    """(example id, answer) -> the label tokens of that answer, over every batch of a layout.

    Raises if an answer appears twice. Answer 0 is chosen, 1 rejected; a span with row -1 is
    an answer that batch does not hold.
    """
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    for batch in batches:
        for n, ex in enumerate(batch.example_ids):
            for answer in (0, 1):
                row, start, end = (int(x) for x in batch.spans[n, answer])
                if row < 0:
                    continue
                key = (int(ex), answer)
                if key in seen:
                    raise RuntimeError(f"answer {key} appears twice in one layout")
                seen[key] = tuple(int(t) for t in batch.labels[row, start:end])
    return seen


def check_same_answers(layouts: dict[str, list[Any]]) -> dict[str, int]:
    """Both layouts hold the same (pair, answer) set with identical label tokens; returns the
    number of pairs, answers and answer tokens (raises, naming the difference, otherwise)."""
    cover = {name: answer_coverage(batches) for name, batches in layouts.items()}
    (a, ca), (b, cb) = cover.items()
    if ca.keys() != cb.keys():
        only = sorted(ca.keys() ^ cb.keys())[:5]
        raise RuntimeError(f"{a} and {b} cover different answers, e.g. {only}")
    differ = [key for key in ca if ca[key] != cb[key]]
    if differ:
        raise RuntimeError(f"{a} and {b} train different tokens for answers {differ[:5]}")
    pairs = {ex for ex, _ in ca}
    if any((ex, answer) not in ca for ex in pairs for answer in (0, 1)):
        raise RuntimeError("a pair is missing one of its answers")
    return {
        "pairs": len(pairs),
        "answers": len(ca),
        "answer_tokens": sum(len(t) for t in ca.values()),
    }


class LayoutRunner:
    """One layout's model (from `--seed`), frozen reference, optimizer and batches."""

    def __init__(self, name: str, batches: list[Any], args: argparse.Namespace) -> None:
        import paddle

        from flashcp.models import build_model, preset

        paddle.seed(args.seed)
        self.name, self.batches, self.args = name, batches, args
        self.policy = build_model(preset(args.preset))
        self.policy.train()
        self.reference = copy.deepcopy(self.policy)
        for p in self.reference.parameters():
            p.stop_gradient = True
        self.reference.eval()
        self.optimizer = paddle.optimizer.AdamW(
            learning_rate=args.lr, parameters=self.policy.parameters()
        )
        self.result = LayoutResult(
            name=name,
            batches=len(batches),
            rows=sum(b.shape[0] for b in batches),
            row_lengths=sorted({b.shape[1] for b in batches}),
            positions=sum(b.shape[0] * b.shape[1] for b in batches),
            real_positions=sum(b.num_real_tokens for b in batches),
        )
        self.initial: dict[tuple[int, int], float] = {}

    def run_pass(self, timed: bool) -> float:
        """One pass over the batches (the first also records the initial reference log-probs)."""
        import paddle

        from flashcp.recipes.dpo_loss import answer_logps, dpo_terms

        first = not self.initial
        start = time.perf_counter()
        losses = []
        for batch in self.batches:
            if not (batch.spans[:, :, 0] >= 0).all():
                raise RuntimeError(f"{self.name}: a batch holds half a pair")
            with paddle.no_grad():
                ref_c, ref_r = answer_logps(self.reference, batch)
            if first:
                for n, ex in enumerate(batch.example_ids):
                    self.initial[(int(ex), 0)] = float(ref_c[n])
                    self.initial[(int(ex), 1)] = float(ref_r[n])
            chosen, rejected = answer_logps(self.policy, batch)
            per, _, _ = dpo_terms(chosen, rejected, ref_c, ref_r, beta=self.args.beta)
            loss = per.mean()
            loss.backward()
            self.optimizer.step()
            self.optimizer.clear_grad()
            losses.append(float(loss))
        elapsed = time.perf_counter() - start
        if timed:
            self.result.pass_seconds.append(elapsed)
            self.result.losses.append(float(np.mean(losses)))
        print(f"{self.name}: {'timed' if timed else 'warm-up'} pass {elapsed:.2f} s, mean loss "
              f"{np.mean(losses):.4f}", file=sys.stderr)  # fmt: skip
        return elapsed


def run_interleaved(runners: dict[str, LayoutRunner], epochs: int) -> list[dict[str, Any]]:
    """Warm-up pass each, then `epochs` rounds alternating the order; per-round records."""
    for runner in runners.values():
        runner.run_pass(timed=False)
    records = []
    for rnd in rounds.interleave(list(runners), epochs):
        seconds = {name: runners[name].run_pass(timed=True) for name in rnd.order}
        records.append(
            {
                "order": rnd.order,
                "seconds": seconds,
                "speedup": seconds["unpacked"] / seconds["packed"],
            }
        )
    return records


def report(
    args: argparse.Namespace,
    examples: list[Any],
    runners: dict[str, LayoutRunner],
    records: list[dict[str, Any]],
    coverage: dict[str, int],
    load: dict[str, list[float]],
) -> dict:
    tokens = example_tokens(examples)
    rows = {}
    for name, runner in runners.items():
        res = runner.result
        seconds = res.median_seconds
        rows[name] = {
            "batches_per_pass": res.batches,
            "rows_per_pass": res.rows,
            "row_lengths": res.row_lengths,
            "positions_per_pass": res.positions,
            "example_positions_per_pass": res.real_positions,
            "pass_seconds": res.pass_seconds,
            "median_pass_seconds": seconds,
            "pass_seconds_spread": stats.spread(res.pass_seconds),
            "example_tokens_per_s": tokens / seconds,
            "positions_per_s": res.positions / seconds,
            "mean_loss_per_pass": res.losses,
        }
    packed, unpacked = runners["packed"].initial, runners["unpacked"].initial
    ref = {key: packed[key] - unpacked[key] for key in packed}
    return {
        "benchmark": "bench_dpo",
        "command": " ".join(["python scripts/bench_dpo.py", *args.argv]),
        "model": args.preset,
        "examples": len(examples),
        "example_tokens_per_pass": tokens,
        "coverage": {**coverage, "identical_in_both_layouts": True},
        "packed": {"seq_len": args.seq_len, "rows_per_step": args.rows},
        "unpacked": {"buckets": args.buckets, "sequences_per_step": args.unpacked_rows},
        "epochs_timed": args.epochs,
        "rounds": records,
        "layouts": rows,
        "speedup": stats.spread([r["speedup"] for r in records]),
        "max_initial_ref_logp_diff": max(abs(v) for v in ref.values()),
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            **load,
        },
    }


PAGE = Page("dpo.md.j2", DOCS / "bench_dpo.json")
"""`docs/bench_dpo.md`, from `docs/bench_dpo.json` alone."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.report_only:
        return PAGE.rewrite(args)
    if args.epochs < 1:
        raise SystemExit("--epochs must be >= 1")
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    examples = build_examples(args)
    batches = layouts(args, examples)
    coverage = check_same_answers(batches)
    runners = {name: LayoutRunner(name, b, args) for name, b in batches.items()}
    with machine.load_window() as load:
        records = run_interleaved(runners, args.epochs)
    rec = report(args, examples, runners, records, coverage, load.as_dict())
    print(f"packed vs unpacked: {rec['speedup']['median']:.2f}× example tokens/s")
    PAGE.write(args, rec)
    return 0
