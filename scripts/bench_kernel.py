"""Benchmark the CPU reference FlashMask kernel against Paddle's dense-mask SDPA.

Workload: causal document mask with `--docs` equal documents, B=1, H heads, head_dim D,
float32, forward + backward. flashcp runs `flashcp.attention.flashmask_attention` (the
front door, PyLayer included) with the 1-column FlashMask mask; the baseline runs
`paddle.nn.functional.scaled_dot_product_attention` with the equivalent dense additive float
mask `[1, 1, S, S]` (0 / -inf) and `out.backward`.

Every (implementation, S) point runs in a fresh subprocess with OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to `--threads` (default 1), so timings and peak
memory are not polluted by earlier runs. Peak memory is the growth of the process's peak RSS
(`ru_maxrss`) over its value after q/k/v/dout were created, so it includes the mask each
implementation needs (the dense `S x S` mask counts against SDPA).

Usage:
    python scripts/bench_kernel.py                       # default sweep, writes docs/*.json
    python scripts/bench_kernel.py --seq-lens 1024 --sdpa-max-seq 1024 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "docs" / "bench_kernel.json"
IMPLS = ("flashcp", "sdpa")


def _rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _doc_lts(seq_len: int, docs: int):
    import numpy as np

    bounds = np.linspace(0, seq_len, docs + 1).astype(np.int64)
    doc_of = np.searchsorted(bounds, np.arange(seq_len), side="right") - 1
    return bounds[doc_of + 1].astype(np.int32).reshape(1, 1, seq_len, 1)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One (impl, S) measurement in this process; returns a JSON-able record."""
    import numpy as np
    import paddle

    S, H, D = args.seq_len, args.heads, args.head_dim
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, S, H, D), dtype=np.float32) for _ in range(4)]
    q, k, v = (paddle.to_tensor(a, stop_gradient=False) for a in arrays[:3])
    dout = paddle.to_tensor(arrays[3])
    del arrays
    lts = _doc_lts(S, args.docs)
    base_rss = _rss_mb()

    if args.impl == "flashcp":
        from flashcp.attention import flashmask_attention_with_version
        from flashcp.kernels import registry
        from flashcp.kernels.cpu_reference import CpuReferenceBackend

        backend = CpuReferenceBackend(
            block_q=args.block_q, block_k=args.block_k, max_merge_cols=args.max_merge_cols
        )
        registry._instances[registry.CPU_BACKEND] = backend
        mask = paddle.to_tensor(lts)
        stats = backend.plan(mask, batch=1, q_len=S, k_len=S, causal=True).stats()

        def fwd():
            return flashmask_attention_with_version(q, k, v, mask, causal=True, fa_version=2)

    else:
        import paddle.nn.functional as F

        rows = np.arange(S)
        stats = {}

        # allowed iff same document and key <= query, built one row block at a time
        bias = np.empty((1, 1, S, S), dtype=np.float32)
        doc_end = lts.reshape(-1)
        for r0 in range(0, S, 1024):
            r = rows[r0 : r0 + 1024, None]
            ok = (rows[None, :] <= r) & (doc_end[None, :] > r) & (doc_end[None, :] == doc_end[r])
            bias[0, 0, r0 : r0 + 1024] = np.where(ok, 0.0, -np.inf)
        dense = paddle.to_tensor(bias)
        del bias

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    fwd_times, bwd_times = [], []
    checksum = 0.0
    for _ in range(args.repeats):
        for t in (q, k, v):
            t.clear_gradient()
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        fwd_times.append(t1 - t0)
        bwd_times.append(t2 - t1)
        checksum = float(out.astype("float64").sum()) + float(q.grad.astype("float64").sum())
        del out
    return {
        "impl": args.impl,
        "seq_len": S,
        "fwd_s": min(fwd_times),
        "bwd_s": min(bwd_times),
        "total_s": min(f + b for f, b in zip(fwd_times, bwd_times, strict=True)),
        "all_fwd_s": fwd_times,
        "all_bwd_s": bwd_times,
        "peak_rss_growth_mb": _rss_mb() - base_rss,
        "tiles": stats,
        "checksum": checksum,
    }


def _run_point(args: argparse.Namespace, impl: str, seq_len: int) -> dict[str, Any]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(args.threads)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--impl",
        impl,
        "--seq-len",
        str(seq_len),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--docs",
        str(args.docs),
        "--repeats",
        str(args.repeats),
        "--block-q",
        str(args.block_q),
        "--block-k",
        str(args.block_k),
        "--max-merge-cols",
        str(args.max_merge_cols),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"impl": impl, "seq_len": seq_len, "error": proc.stderr.strip()[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine() -> dict[str, Any]:
    import numpy as np
    import paddle

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "paddle": paddle.__version__,
    }


def _table(results: list[dict[str, Any]]) -> str:
    by = {(r["impl"], r["seq_len"]): r for r in results if "error" not in r}
    lens = sorted({r["seq_len"] for r in results})
    lines = [
        "| S | flashcp fwd+bwd (s) | flashcp peak RSS growth (MiB) | SDPA fwd+bwd (s) "
        "| SDPA peak RSS growth (MiB) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for s in lens:
        f, d = by.get(("flashcp", s)), by.get(("sdpa", s))
        row = [str(s)]
        row += [f"{f['total_s']:.2f}", f"{f['peak_rss_growth_mb']:.0f}"] if f else ["-", "-"]
        row += [f"{d['total_s']:.2f}", f"{d['peak_rss_growth_mb']:.0f}"] if d else ["-", "-"]
        row.append(f"{d['total_s'] / f['total_s']:.1f}x" if f and d else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-lens", default="2048,4096,8192,16384", help="comma-separated S values")
    p.add_argument("--sdpa-max-seq", type=int, default=8192, help="largest S run with SDPA")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--docs", type=int, default=8, help="documents in the causal-document mask")
    p.add_argument("--repeats", type=int, default=2, help="runs per point (min is reported)")
    p.add_argument("--threads", type=int, default=1, help="OMP/OpenBLAS/MKL threads per run")
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--max-merge-cols", type=int, default=1024)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    lens = [int(s) for s in args.seq_lens.split(",") if s.strip()]
    results = []
    for s in lens:
        for impl in IMPLS:
            if impl == "sdpa" and s > args.sdpa_max_seq:
                continue
            rec = _run_point(args, impl, s)
            results.append(rec)
            shown = rec.get("error") or f"fwd {rec['fwd_s']:.2f}s bwd {rec['bwd_s']:.2f}s"
            print(f"{impl:8s} S={s:6d}: {shown}", flush=True)
    report = {
        "workload": {
            "mask": f"causal document, {args.docs} equal documents",
            "batch": 1,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": "float32",
            "threads": args.threads,
            "repeats": args.repeats,
            "flashcp_blocks": {
                "block_q": args.block_q,
                "block_k": args.block_k,
                "max_merge_cols": args.max_merge_cols,
            },
        },
        "machine": _machine(),
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(_table(results))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
