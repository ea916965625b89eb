"""Peak memory (and time) of the LM head + loss: chunked vs the full float32 logits, in one run.

One forward + backward of `-sum(log p(label)) / T` from hidden states `[1, T, H]` through a
bias-free `nn.Linear(H, V)` head (the GLM head), once unchunked (`train.loss_chunk_tokens: 0`:
the whole `[T, V]` float32 logits, `flashcp.models.head.token_logprobs`) and once chunked
(`flashcp.models.head.chunked_token_logprobs`, chunks of `n` tokens recomputed in backward).
Peak = the allocator's highest tensor bytes above the start of the pass
(`flashcp.metrics.memory.PeakMeter`: Paddle's host allocator statistics on CPU, exact bytes of
Paddle tensors). The two variants alternate, `--repeats` times each; the table gives medians
(the peak is the same every repeat) and the time's spread. Next to the measurements, the sizes
that bound them (`tests/unit/models/test_head.py` asserts the same bounds):

* unchunked >= T·V·4: the float32 logits (on CPU the numpy log-softmax of
  `flashcp.models.cpu_elementwise` turns them into their gradient in place; Paddle's
  cross-entropy, on a GPU, has its softmax and then the gradient beside them: 2·T·V·4);
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
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench import machine, rounds, stats
from bench.report import DOCS, Page

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
        return self.tokens * self.vocab * 4

    def chunked_bound(self) -> int:
        t, v, h, n = self.tokens, self.vocab, self.hidden, min(self.chunk, self.tokens)
        return 3 * n * v * 4 + 2 * h * v * 4 + 4 * t * h * 4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated TxVxH:n cases")
    p.add_argument("--repeats", type=int, default=3, help="passes per variant (interleaved)")
    p.add_argument("--seed", type=int, default=0)
    PAGE.add_arguments(p)
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
    chunks = {"unchunked": 0, "chunked": size.chunk}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in chunks}
    for rnd in rounds.interleave(list(chunks), repeats, rotate=False):  # unchunked first
        for name in rnd.order:
            runs[name].append(one_pass(head, hidden, labels, chunks[name]))
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
        sec = stats.spread(secs)
        out[name] = {
            "peak_bytes": stats.median(peaks),
            "peak_bytes_all": peaks,
            "seconds_all": secs,
            "seconds_median": sec["median"],
            "seconds_min": sec["min"],
            "seconds_max": sec["max"],
            "loss": rs[0]["loss"],
        }
    u, c = out["unchunked"], out["chunked"]
    out["peak_ratio"] = c["peak_bytes"] / u["peak_bytes"]
    paired = stats.spread(
        stats.ratios(
            [r["seconds"] for r in runs["chunked"]], [r["seconds"] for r in runs["unchunked"]]
        )
    )
    out["time_ratio"] = paired["median"]
    out["time_ratio_min"], out["time_ratio_max"] = paired["min"], paired["max"]
    out["loss_rel_diff"] = abs(c["loss"] - u["loss"]) / abs(u["loss"])
    out["within_bounds"] = bool(
        u["peak_bytes"] >= size.unchunked_floor() and c["peak_bytes"] <= size.chunked_bound()
    )
    return out


def steady(rec: dict[str, Any]) -> bool:
    """Whether every case's peak was identical over its repeats (both variants)."""
    return all(
        len(set(r[v]["peak_bytes_all"])) == 1
        for r in rec["cases"]
        for v in ("unchunked", "chunked")
    )


def view(rec: dict[str, Any]) -> dict[str, Any]:
    """The page's derived figures: whether the peaks kept their bounds and were steady."""
    return {"within": all(r["within_bounds"] for r in rec["cases"]), "steady": steady(rec)}


PAGE = Page("loss_memory.md.j2", DOCS / "loss_memory.json", view=view)
"""`docs/loss_memory.md`, from `docs/loss_memory.json` alone."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return PAGE.rewrite(args)
    import paddle

    paddle.set_device("cpu")
    sizes = [Size.parse(s) for s in args.sizes.split(",") if s.strip()]
    cases = []
    with machine.load_window() as load:
        for size in sizes:
            case = run_size(size, args.repeats, args.seed)
            cases.append(case)
            print(
                f"{size.label:>22}  unchunked {case['unchunked']['peak_bytes'] / MIB:,.1f} MiB  "
                f"chunked {case['chunked']['peak_bytes'] / MIB:,.1f} MiB  ratio "
                f"{case['peak_ratio']:.3f}  time ratio {case['time_ratio']:.2f}  within bounds "
                f"{case['within_bounds']}"
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
            **load.as_dict(),
        },
    }
    PAGE.write(args, rec)
    return 0 if all(c["within_bounds"] for c in cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
