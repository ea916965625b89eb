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
of those positions carry example tokens. Each layout runs `--epochs` passes over the examples
after one untimed warm-up pass; the fastest pass is reported. As a check that both layouts see
the same examples and model, the initial reference log-probs of every answer are compared
between the layouts (they must agree to float rounding).

Writes `--json` (default docs/bench_dpo.json) and `--markdown` (default docs/bench_dpo.md).

Usage:
    python scripts/bench_dpo.py                      # default: small_glm, 512-token rows
    python scripts/bench_dpo.py --preset tiny_glm --repeat 1 --epochs 1 --json /tmp/b.json
    python scripts/bench_dpo.py --report-only        # rewrite docs/bench_dpo.md from the JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


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
    def best_seconds(self) -> float:
        return min(self.pass_seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small_glm", help="model preset (default small_glm)")
    p.add_argument("--seq-len", type=int, default=512, help="packed row length")
    p.add_argument("--rows", type=int, default=1, help="packed rows per step")
    p.add_argument("--buckets", default="64,128,192,256,384,512", help="unpacked lengths")
    p.add_argument("--unpacked-rows", type=int, default=8, help="unpacked sequences per step")
    p.add_argument("--repeat", type=int, default=2, help="passes of the built-in set per epoch")
    p.add_argument("--epochs", type=int, default=2, help="timed passes per layout")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="OMP threads (default: as set)")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench_dpo.json"))
    p.add_argument("--markdown", default=None, help="default: the JSON path with .md")
    p.add_argument(
        "--report-only", action="store_true", help="rewrite the markdown from --json, no run"
    )
    return p.parse_args(argv)


def build_examples(args: argparse.Namespace) -> list[Any]:
    from flashcp.data.tokenizer import ByteTokenizer
    from flashcp.recipes.dpo_data import fit_examples, read_dpo_jsonl, tokenize_dpo

    records = read_dpo_jsonl(None) * args.repeat
    examples = tokenize_dpo(records, ByteTokenizer())
    top = max(int(b) for b in args.buckets.split(","))
    # truncate once for the tighter of the two budgets, then both layouts get these tokens
    examples = fit_examples(examples, top, layout="unpacked", truncation="truncate")
    return fit_examples(examples, args.seq_len, layout="packed", truncation="truncate")


def layouts(args: argparse.Namespace, examples: list[Any]) -> dict[str, list[Any]]:
    from flashcp.data.tokenizer import ByteTokenizer
    from flashcp.recipes.dpo_data import pack_dpo_batches, unpack_dpo

    pad = ByteTokenizer().pad_id
    buckets = [int(b) for b in args.buckets.split(",")]
    packed = list(pack_dpo_batches(examples, args.seq_len, args.rows, pad_id=pad))
    unpacked = unpack_dpo(
        examples, buckets, pad_id=pad, rows_per_batch=args.unpacked_rows, paired=True
    )
    return {"packed": packed, "unpacked": unpacked}


def example_tokens(examples: Sequence[Any]) -> int:
    return sum(len(e.prompt) + len(e.chosen) + len(e.rejected) for e in examples)


def train_layout(
    name: str, batches: list[Any], args: argparse.Namespace
) -> tuple[LayoutResult, dict[tuple[int, int], float]]:
    """Warm-up pass, then `--epochs` timed passes; returns the result and the initial
    reference log-prob of every (example, answer)."""
    import paddle

    from flashcp.models import build_model, preset
    from flashcp.recipes.dpo_loss import answer_logps, dpo_terms

    paddle.seed(args.seed)
    policy = build_model(preset(args.preset))
    policy.train()
    reference = copy.deepcopy(policy)
    for p in reference.parameters():
        p.stop_gradient = True
    reference.eval()
    optimizer = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=policy.parameters())
    result = LayoutResult(
        name=name,
        batches=len(batches),
        rows=sum(b.shape[0] for b in batches),
        row_lengths=sorted({b.shape[1] for b in batches}),
        positions=sum(b.shape[0] * b.shape[1] for b in batches),
        real_positions=sum(b.num_real_tokens for b in batches),
    )
    initial: dict[tuple[int, int], float] = {}
    for epoch in range(args.epochs + 1):
        start = time.perf_counter()
        epoch_losses = []
        for batch in batches:
            keep = batch.spans[:, 0, 0] >= 0  # pairs with both answers here (always, paired)
            with paddle.no_grad():
                ref_c, ref_r = answer_logps(reference, batch)
            if epoch == 0:
                for n, ex in enumerate(batch.example_ids):
                    initial[(int(ex), 0)] = float(ref_c[n])
                    initial[(int(ex), 1)] = float(ref_r[n])
            chosen, rejected = answer_logps(policy, batch)
            per, _, _ = dpo_terms(chosen, rejected, ref_c, ref_r, beta=args.beta)
            if not keep.all():
                raise RuntimeError(f"{name}: a batch holds half a pair")
            loss = per.mean()
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            epoch_losses.append(float(loss))
        elapsed = time.perf_counter() - start
        if epoch > 0:  # epoch 0 is the warm-up
            result.pass_seconds.append(elapsed)
            result.losses.append(float(np.mean(epoch_losses)))
        print(f"{name}: pass {epoch} {elapsed:.2f} s, mean loss {np.mean(epoch_losses):.4f}",
              file=sys.stderr)  # fmt: skip
    return result, initial


def report(args: argparse.Namespace, examples: list[Any], results: dict[str, Any]) -> dict:
    tokens = example_tokens(examples)
    rows = {}
    for name, (res, _) in results.items():
        seconds = res.best_seconds
        rows[name] = {
            "batches_per_pass": res.batches,
            "rows_per_pass": res.rows,
            "row_lengths": res.row_lengths,
            "positions_per_pass": res.positions,
            "example_positions_per_pass": res.real_positions,
            "pass_seconds": res.pass_seconds,
            "best_pass_seconds": seconds,
            "example_tokens_per_s": tokens / seconds,
            "positions_per_s": res.positions / seconds,
            "mean_loss_per_pass": res.losses,
        }
    ref = {k: results["packed"][1][k] - results["unpacked"][1][k] for k in results["packed"][1]}
    return {
        "benchmark": "bench_dpo",
        "model": args.preset,
        "examples": len(examples),
        "example_tokens_per_pass": tokens,
        "packed": {"seq_len": args.seq_len, "rows_per_step": args.rows},
        "unpacked": {"buckets": args.buckets, "sequences_per_step": args.unpacked_rows},
        "epochs_timed": args.epochs,
        "layouts": rows,
        "speedup": rows["packed"]["example_tokens_per_s"]
        / rows["unpacked"]["example_tokens_per_s"],
        "max_initial_ref_logp_diff": max(abs(v) for v in ref.values()),
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        },
    }


def markdown(rec: dict) -> str:
    p, u = rec["layouts"]["packed"], rec["layouts"]["unpacked"]

    def line(name: str, r: dict) -> str:
        used = r["example_positions_per_pass"] / r["positions_per_pass"]
        return (
            f"| {name} | {r['rows_per_pass']} × {r['row_lengths']} | {r['positions_per_pass']:,}"
            f" | {used:.0%} | {r['best_pass_seconds']:.2f} | {r['example_tokens_per_s']:,.0f} "
            f"| {r['positions_per_s']:,.0f} |"
        )

    return "\n".join(
        [
            "# DPO benchmark: share-question packing vs unpacked",
            "",
            "`scripts/bench_dpo.py` trains DPO on the same preference pairs with the same model "
            "in one process, once with share-question packing and once with the unpacked "
            "baseline, and compares throughput. Raw numbers: [`bench_dpo.json`](bench_dpo.json).",
            "",
            "## Workload",
            "",
            f"* model `{rec['model']}` (CPU, float32, flashcp's CPU FlashMask kernel), frozen "
            "reference copy, sigmoid DPO (β 0.1), AdamW;",
            f"* {rec['examples']} pairs (the built-in preference set × "
            f"{rec['examples'] // 52}, byte tokenizer), {rec['example_tokens_per_pass']:,} "
            "example tokens per pass (prompt + chosen + rejected per pair);",
            f"* packed: rows of {rec['packed']['seq_len']} tokens, "
            f"{rec['packed']['rows_per_step']} row(s) per step, several pairs per row, each as "
            "the prompt once followed by both answers (positions restart per answer, "
            "share-question FlashMask);",
            f"* unpacked: `prompt + answer` per answer (prompt repeated), padded to the smallest "
            f"bucket of {rec['unpacked']['buckets']} holding the pair's longer answer, "
            f"{rec['unpacked']['sequences_per_step']} sequences per step;",
            f"* one step = reference forward + policy forward/backward + AdamW; one untimed "
            f"warm-up pass, then the fastest of {rec['epochs_timed']} timed passes.",
            "",
            "Example tokens/s counts each pair's prompt, chosen and rejected tokens once, the "
            "same number for both layouts, so the speedup is the ratio of the time a pass over "
            "the same pairs takes. Positions/s counts every computed position (padding and "
            "repeated prompts included).",
            "",
            "## Result",
            "",
            "| layout | rows × lengths | positions / pass | example share | best pass (s) "
            "| example tokens/s | positions/s |",
            "|---|---|---|---|---|---|---|",
            line("packed", p),
            line("unpacked", u),
            "",
            f"**Speedup of packing: {rec['speedup']:.2f}×** example tokens per second "
            "(target ≥ 1.5×).",
            "",
            "Same examples and model: the initial reference log-prob of every answer agrees "
            f"between the layouts to {rec['max_initial_ref_logp_diff']:.1e} (float rounding).",
            "",
            "Where the gain comes from: the unpacked layout computes each prompt twice and pads "
            "every sequence to its bucket, so only "
            f"{u['example_positions_per_pass'] / u['positions_per_pass']:.0%} of its positions "
            "hold example tokens (and a prompt counts twice among those); packed rows carry "
            f"{p['example_positions_per_pass'] / p['positions_per_pass']:.0%}. Per computed "
            f"position the packed layout runs at {p['positions_per_s'] / u['positions_per_s']:.2f}"
            "× the unpacked speed (its rows are longer, so each position attends over more "
            "keys; the kernel skips the tiles the share-question mask hides entirely, but not "
            "the partly masked ones), so the speedup is close to the ratio of positions the two "
            "layouts compute.",
            "",
            f"Environment: Python {rec['environment']['python']}, "
            f"{rec['environment']['cpus']} CPUs, OMP_NUM_THREADS="
            f"{rec['environment']['omp_threads']}.",
            "",
            "Reproduce: `python scripts/bench_dpo.py` (defaults as above).",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    md = Path(args.markdown) if args.markdown else Path(args.json).with_suffix(".md")
    if args.report_only:
        md.write_text(markdown(json.loads(Path(args.json).read_text())))
        print(f"wrote {md}")
        return 0
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    examples = build_examples(args)
    batches = layouts(args, examples)
    results = {name: train_layout(name, b, args) for name, b in batches.items()}
    rec = report(args, examples, results)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    md.write_text(markdown(rec))
    print(f"packed vs unpacked: {rec['speedup']:.2f}× example tokens/s; wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
