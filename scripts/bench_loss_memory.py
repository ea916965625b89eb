"""Peak memory (and time) of the LM head + loss: chunked vs the full float32 logits, in one run.

One forward + backward of `-sum(log p(label)) / T` from hidden states `[1, T, H]` through a
bias-free `nn.Linear(H, V)` head (the GLM head), once unchunked (`train.loss_chunk_tokens: 0`:
the whole `[T, V]` float32 logits, Paddle's cross-entropy) and once chunked
(`flashcp.models.head.chunked_token_logprobs`, chunks of `n` tokens recomputed in backward).
Peak = the allocator's highest tensor bytes above the start of the pass
(`flashcp.metrics.memory.PeakMeter`: Paddle's host allocator statistics on CPU, exact bytes of
Paddle tensors). The two variants alternate, `--repeats` times each; the table gives medians
(the peak is the same every repeat) and the time's spread. Next to the measurements, the sizes
that bound them (`tests/unit/test_loss_chunking.py` asserts the same bounds):

* unchunked >= 2·T·V·4: the float32 logits (or the cross-entropy's softmax) and their gradient
  are alive together;
* chunked <= 3·n·V·4 + 2·H·V·4 + 4·T·H·4: one chunk's logits, softmax and gradient, the head
  weight's gradient plus the chunk's partial being added to it, and hidden-sized tensors.

The machine's 1-minute load average before and after is recorded (other jobs may share the
cores: the peaks do not depend on them, the times do).

Writes `--json` (default docs/loss_memory.json) and `--markdown` (default: the JSON path with
.md, i.e. docs/loss_memory.md).

Usage:
    python scripts/bench_loss_memory.py                        # the sizes in docs/loss_memory.md
    python scripts/bench_loss_memory.py --sizes 512x4096x32:128 --repeats 3 --json /tmp/m.json
    python scripts/bench_loss_memory.py --report-only          # rewrite the .md from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = "2048x32768x64:256,4096x65536x128:1024,4096x151552x128:1024"
"""`TxVxH:n` per case: tokens, vocabulary, hidden size, chunk tokens (151552: GLM-4's)."""
MIB = 2**20


@dataclass(frozen=True)
class Size:
    tokens: int
    vocab: int
    hidden: int
    chunk: int

    @classmethod
    def parse(cls, text: str) -> Size:
        try:
            shape, chunk = text.split(":")
            t, v, h = (int(x) for x in shape.lower().split("x"))
            size = cls(t, v, h, int(chunk))
        except ValueError as err:
            raise SystemExit(
                f"--sizes entry {text!r} is not TxVxH:n (e.g. 2048x32768x64:256)"
            ) from err
        if min(size.tokens, size.vocab, size.hidden, size.chunk) < 1:
            raise SystemExit(f"--sizes entry {text!r}: every number must be >= 1")
        return size

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.vocab}x{self.hidden}:{self.chunk}"

    def unchunked_floor(self) -> int:
        return 2 * self.tokens * self.vocab * 4

    def chunked_bound(self) -> int:
        t, v, h, n = self.tokens, self.vocab, self.hidden, min(self.chunk, self.tokens)
        return 3 * n * v * 4 + 2 * h * v * 4 + 4 * t * h * 4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated TxVxH:n cases")
    p.add_argument("--repeats", type=int, default=3, help="passes per variant (interleaved)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "docs" / "loss_memory.json"))
    p.add_argument("--markdown", default=None, help="default: the JSON path with .md")
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite the markdown from --json"
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    return args


def one_pass(head: Any, hidden: np.ndarray, labels: np.ndarray, chunk: int) -> dict[str, float]:
    """Forward + backward of the summed log-prob loss; peak bytes above the start, seconds."""
    import paddle

    from flashcp.metrics.memory import PeakMeter
    from flashcp.models.head import chunked_token_logprobs

    head.weight.clear_gradient(False)
    h = paddle.to_tensor(hidden)
    h.stop_gradient = False
    y = paddle.to_tensor(labels)
    start = time.perf_counter()
    with PeakMeter() as meter:
        logp = chunked_token_logprobs(lambda x: head(x).astype("float32"), h, y, chunk_tokens=chunk)
        loss = -logp.sum() / float(labels.size)
        loss.backward()
    seconds = time.perf_counter() - start
    return {"peak_bytes": meter.peak_bytes, "seconds": seconds, "loss": float(loss)}


def run_size(size: Size, repeats: int, seed: int) -> dict[str, Any]:
    import paddle

    paddle.seed(seed)
    head = paddle.nn.Linear(size.hidden, size.vocab, bias_attr=False)
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((1, size.tokens, size.hidden)).astype(np.float32)
    labels = rng.integers(0, size.vocab, (1, size.tokens))
    runs: dict[str, list[dict[str, float]]] = {"unchunked": [], "chunked": []}
    for _ in range(repeats):  # interleaved: one of each per repeat
        runs["unchunked"].append(one_pass(head, hidden, labels, 0))
        runs["chunked"].append(one_pass(head, hidden, labels, size.chunk))
    out: dict[str, Any] = {
        "tokens": size.tokens,
        "vocab": size.vocab,
        "hidden": size.hidden,
        "chunk": size.chunk,
        "logits_bytes": size.tokens * size.vocab * 4,
        "unchunked_floor_bytes": size.unchunked_floor(),
        "chunked_bound_bytes": size.chunked_bound(),
    }
    for name, rs in runs.items():
        peaks = [r["peak_bytes"] for r in rs]
        secs = [r["seconds"] for r in rs]
        out[name] = {
            "peak_bytes": statistics.median(peaks),
            "peak_bytes_all": peaks,
            "seconds_all": secs,
            "seconds_median": statistics.median(secs),
            "seconds_min": min(secs),
            "seconds_max": max(secs),
            "loss": rs[0]["loss"],
        }
    u, c = out["unchunked"], out["chunked"]
    out["peak_ratio"] = c["peak_bytes"] / u["peak_bytes"]
    paired = [
        rc["seconds"] / ru["seconds"]
        for ru, rc in zip(runs["unchunked"], runs["chunked"], strict=True)
    ]
    out["time_ratio"] = statistics.median(paired)
    out["time_ratio_min"], out["time_ratio_max"] = min(paired), max(paired)
    out["loss_rel_diff"] = abs(c["loss"] - u["loss"]) / abs(u["loss"])
    out["within_bounds"] = bool(
        u["peak_bytes"] >= size.unchunked_floor() and c["peak_bytes"] <= size.chunked_bound()
    )
    return out


def _mib(x: float) -> str:
    return f"{x / MIB:,.1f}"


def load_text(env: dict[str, Any]) -> str:
    if "loadavg_before" not in env:
        return "load not recorded"
    before, after = env["loadavg_before"][0], env["loadavg_after"][0]
    return f"load average {before:.2f} before, {after:.2f} after (1 minute)"


def steady(rec: dict[str, Any]) -> bool:
    """Whether every case's peak was identical over its repeats (both variants)."""
    return all(
        len(set(r[v]["peak_bytes_all"])) == 1
        for r in rec["cases"]
        for v in ("unchunked", "chunked")
    )


def scale_note(
    tokens: int = 16384, vocab: int = 151552, chunks: Sequence[int] = (4096, 1024)
) -> str:
    """What the buffers are at GLM-4's vocabulary and a 16k-token local sequence."""
    gib = 2**30
    full = tokens * vocab * 4 / gib
    parts = ", ".join(f"{3 * n * vocab * 4 / gib:.1f} GiB at n = {n}" for n in chunks)
    return (
        f"At GLM-4's vocabulary (V = {vocab:,}) and {tokens:,} local tokens, one [T, V] float32 "
        f"tensor is {full:.1f} GiB and the unchunked loss holds two ({2 * full:.1f} GiB); the "
        f"chunked one at most one chunk's three [n, V] buffers (the bound; the peaks measured "
        f"above stay below it): {parts}. The head weight's "
        "gradient ([H, V], plus the chunk's partial while it is added) is there in both "
        "paths when the head trains; under LoRA on the attention only, the head is frozen and "
        "gets none."
    )


def markdown(rec: dict[str, Any]) -> str:
    rows = []
    for r in rec["cases"]:
        u, c = r["unchunked"], r["chunked"]
        rows.append(
            f"| {r['tokens']:,} | {r['vocab']:,} | {r['hidden']} | {r['chunk']:,} "
            f"| {_mib(r['logits_bytes'])} | {_mib(u['peak_bytes'])} | {_mib(c['peak_bytes'])} "
            f"| **{r['peak_ratio']:.3f}** | {_mib(r['unchunked_floor_bytes'])} "
            f"| {_mib(r['chunked_bound_bytes'])} "
            f"| {u['seconds_median']:.2f} ({u['seconds_min']:.2f}–{u['seconds_max']:.2f}) "
            f"| {c['seconds_median']:.2f} ({c['seconds_min']:.2f}–{c['seconds_max']:.2f}) "
            f"| {r['time_ratio']:.2f} ({r['time_ratio_min']:.2f}–{r['time_ratio_max']:.2f}) "
            f"| {r['loss_rel_diff']:.1e} |"
        )
    env = rec["environment"]
    return "\n".join(
        [
            "# Loss memory: chunked LM head + log-probs vs the full logits",
            "",
            "`scripts/bench_loss_memory.py` runs one forward + backward of the LM loss "
            "(`-sum log p(label) / T`) from hidden states `[1, T, H]` through a bias-free "
            "`Linear(H, V)` head, unchunked (`train.loss_chunk_tokens: 0`, the whole `[T, V]` "
            "float32 logits) and chunked (chunks of `n` tokens, each chunk's logits recomputed "
            "in backward: `flashcp.models.head`), alternating, "
            f"{rec['repeats']} passes each. Raw numbers: [`loss_memory.json`](loss_memory.json).",
            "",
            "Peak = the allocator's highest tensor bytes above the start of the pass (Paddle's "
            "host allocator statistics on CPU: exact bytes of Paddle tensors; "
            "`flashcp.metrics.memory`). MiB throughout. *floor* = 2·T·V·4, the logits (or "
            "softmax) and their gradient alive together; *bound* = 3·n·V·4 + 2·H·V·4 + "
            "4·T·H·4, one chunk's logits, softmax and gradient, the head weight's gradient and "
            "the chunk's partial, and hidden-sized tensors "
            "(`tests/unit/test_loss_chunking.py` asserts both at T = 2048, V = 32,768).",
            "",
            "| T | V | H | n | one [T, V] f32 | unchunked peak | chunked peak | ratio "
            "| floor | bound | unchunked s (min–max) | chunked s (min–max) | time ratio (min–max) "
            "| loss rel. diff |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Every measured peak is within its bounds: "
            f"{'yes' if all(r['within_bounds'] for r in rec['cases']) else 'NO'}; each peak "
            f"was {'the same in every repeat' if steady(rec) else 'NOT the same in every repeat'}"
            ". Time (the median of the per-repeat ratios chunked / unchunked, each pair run back "
            "to back): the chunked pass runs four head GEMMs instead of three (the no-grad "
            "forward, its recompute in backward and the two backward GEMMs, against one forward "
            "and two backward), so about 4/3 of the head's time plus a per-chunk overhead that "
            "matters for small chunks; on a shared machine the spread shows how far the timings "
            "can be trusted. The loss agrees to float rounding (relative difference in the last "
            "column).",
            "",
            scale_note(),
            "",
            f"Environment: Python {env['python']}, {env['cpus']} CPUs, "
            f"OMP_NUM_THREADS={env['omp_threads']}, paddle {env['paddle']}; {load_text(env)}. "
            "Other jobs may share the machine: the peaks do not depend on them, the times do "
            "(each repeat runs both variants back to back).",
            "",
            f"Reproduce: `{rec['command']}`.",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.json)
    md_path = Path(args.markdown) if args.markdown else out.with_suffix(".md")
    if args.report_only:
        md_path.write_text(markdown(json.loads(out.read_text())))
        print(f"wrote {md_path}")
        return 0
    import paddle

    paddle.set_device("cpu")
    sizes = [Size.parse(s) for s in args.sizes.split(",") if s.strip()]
    load_before = list(os.getloadavg())
    cases = []
    for size in sizes:
        case = run_size(size, args.repeats, args.seed)
        cases.append(case)
        print(
            f"{size.label:>22}  unchunked {_mib(case['unchunked']['peak_bytes'])} MiB  "
            f"chunked {_mib(case['chunked']['peak_bytes'])} MiB  ratio {case['peak_ratio']:.3f}"
            f"  time ratio {case['time_ratio']:.2f}  within bounds {case['within_bounds']}"
        )
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    rec = {
        "cases": cases,
        "repeats": args.repeats,
        "command": f"python scripts/bench_loss_memory.py {argv_text}".strip(),
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "paddle": paddle.__version__,
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    md_path.write_text(markdown(rec))
    print(f"wrote {out} and {md_path}")
    return 0 if all(c["within_bounds"] for c in cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
