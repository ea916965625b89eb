"""Benchmark flashcp's FlashMask attention against the baselines a user would weigh, per mask.

Workload: B=1, H heads (query = key/value heads), head_dim D, forward + backward, one mask per
family. Per (family, S) point, in ONE fresh subprocess, the implementations are interleaved:

* `flashcp`: the front door (PyLayer included) with the column-wise FlashMask mask (on CPU
  `flashmask_attention_with_version(..., fa_version=2)`, the CPU kernel with the tile sizes
  given here; on GPU `flashmask_attention`, the dispatched FA2/FA3 kernel);
* `sdpa`: `paddle.nn.functional.scaled_dot_product_attention` with the same mask as a dense
  additive float mask `[1, Hm, S, S]` (0 / -inf) built from `flashcp.mask_indices.to_dense`;
* `varlen`: for masks that are block-diagonal documents (causal within each document, or
  bidirectional within each), every document attended alone with dense SDPA (`is_causal` for
  causal documents) and the outputs concatenated: what a per-document (varlen) kernel does,
  the usual alternative to a packed mask;
* `bound` (the ACTIVE-TILE BOUND): the time this machine's GEMM needs for only the FLOPs of
  the tiles the kernel does not skip. In every round the GEMMs of one tile are timed at the
  kernel's shape, batched over the heads as the kernel batches them (the library the kernel
  uses: Paddle's matmul, on CPU through `flashcp.kernels.numpy_bridge`, where numpy's own matmul
  is timed beside it): A = [bq, D] x [D, bk] (QK^T; dP = dO V^T) and
  B = [bq, bk] x [bk, D] (PV; dV, dQ, dK). Forward needs 1 A + 1 B per active tile and head,
  backward 2 A + 3 B (recomputed QK^T, dP, dV, dQ, dK); bound = active tiles x those times.
  The kernel's "% of bound" is bound time / kernel time (100 % = the kernel is as fast as its
  matmuls alone; softmax, masking, copies and Python overhead make up the rest).

Rounds: `--warmup` untimed rounds, then `--rounds` timed rounds; every round runs each
implementation once, in an order rotated by one per round, so machine-load changes hit every
implementation alike. Reported: per implementation the median and min-max over rounds, and
per-round ratios (SDPA / flashcp, varlen / flashcp, bound / flashcp) with their median and
min-max: the ratios pair runs made next to each other. The machine's load average before and
after each point is recorded.

Memory (CPU: growth of the process's peak RSS `ru_maxrss` over its value once q/k/v/dout exist;
GPU: growth of `max_memory_allocated`): flashcp runs first in the first round of its fresh
process, so its figure is its own; SDPA's is the peak growth over its first run above the
memory in use just before (valid because SDPA's peak dominates; recorded only when it set a new
peak). The dense mask is built after the baseline, so it counts against SDPA.

Families: the headline `causal_document_<docs>docs` (`--docs` equal documents) and every entry
of `flashcp.mask_families.FAMILIES` (one seeded mask each, `--seed`). Masks whose heads all
agree are passed with one mask head (Hm = 1). Points: every family at `--seq-lens`, the headline
also at `--headline-seq-lens`; SDPA up to `--sdpa-max-seq`.

Writes `--json` (default docs/bench_kernel.json) and the whole markdown page `--markdown`
(default: the JSON path with `.md`), generated from the JSON alone (`--report-only` regenerates
it without running). Exits 1 when any point failed.

Usage:
    python scripts/bench_kernel.py                       # default CPU sweep, rewrites docs/
    python scripts/bench_kernel.py --quick --json /tmp/k.json    # smoke: 2 families, S = 512
    python scripts/bench_kernel.py --report-only         # page from docs/bench_kernel.json
    python scripts/bench_kernel.py --device gpu --json build/bench_kernel_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import machine, rounds, stats
from bench.report import DOCS, ROOT, Page

ENTRY = ROOT / "scripts" / "bench_kernel.py"
"""The command line this module runs behind; each point's worker process runs it again."""
IMPLS = ("flashcp", "sdpa", "varlen")
DEVICES = ("cpu", "gpu")
FULL_SEQ = 8192
TARGET_SEQ = 8192
TARGET_SPEEDUP = 5.0
HEADLINE_RE = re.compile(r"^causal_document_(\d+)docs$")
GEMM_CALLS = 64
"""Batched tile GEMMs timed per shape and round for the active-tile bound."""
QUICK = {
    "families": "causal_document_8docs,causal",
    "seq_lens": "512",
    "headline_seq_lens": "1024",
    "rounds": 3,
}


def headline_name(docs: int) -> str:
    return f"causal_document_{docs}docs"


def family_names() -> list[str]:
    from flashcp import mask_families

    return list(mask_families.FAMILIES)


def _rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    """Resident set size now, MiB (`/proc/self/statm`); 0 where unavailable."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_mask(family: str, seq_len: int, heads: int, seed: int):
    """The `flashcp.masks.Mask` of `family` for B = 1, with Hm = 1 when all heads agree."""
    import numpy as np

    from flashcp import mask_families, masks

    m = HEADLINE_RE.match(family)
    if m:
        docs = int(m.group(1))
        bounds = np.linspace(0, seq_len, docs + 1).astype(np.int64)
        return masks.causal_document_mask([int(n) for n in np.diff(bounds)])
    if family not in mask_families.FAMILIES:
        raise ValueError(f"unknown mask family {family!r}")
    mask = mask_families.FAMILIES[family](1, seq_len, heads, seed)
    idx = mask.indices
    if idx.shape[1] > 1 and (idx == idx[:, :1]).all():
        mask = masks.Mask(np.ascontiguousarray(idx[:, :1]), mask.causal)
    return mask


def dense_bias(mask: Any):
    """The additive float32 mask `[1, Hm, S, S]`: -inf where `to_dense` says masked, else 0."""
    import numpy as np

    from flashcp import mask_indices

    masked = mask_indices.to_dense(mask.indices, causal=mask.causal)
    return np.where(masked, np.float32(-np.inf), np.float32(0.0))


def _dense_columns(mask: Any, block: int = 512):
    """(c0, allowed[S, c1 - c0]) for successive column blocks of the mask (True = attend).

    Built from the non-causal form of the indices one column block at a time, so no S x S
    array exists: this runs in the parent process, whose peak RSS a forked worker inherits
    (Linux keeps `ru_maxrss` across fork and exec), so it must stay small.
    """
    from flashcp import mask_indices

    nc = mask_indices.to_noncausal(mask.indices, causal=mask.causal)
    s = nc.shape[2]
    for c0 in range(0, s, block):
        cols = nc[:, :, c0 : c0 + block]
        yield c0, ~mask_indices.to_dense(cols, causal=False, q_len=s)[0, 0]


def document_segments(mask: Any) -> dict[str, Any] | None:
    """Documents of a block-diagonal mask, from the dense oracle; None if it is not one.

    Returns {"lengths": [...], "causal": bool}: the mask equals, exactly, every document
    attending only to itself, causally (lower triangle) or bidirectionally. Masks with one
    mask per head, or any other structure, have no per-document equivalent.
    """
    import numpy as np

    if mask.indices.shape[1] != 1:
        return None
    s = mask.indices.shape[2]
    up = np.zeros(s, dtype=bool)  # allowed[j - 1, j]
    down = np.zeros(s, dtype=bool)  # allowed[j + 1, j]
    for c0, allowed in _dense_columns(mask):
        j = np.arange(c0, c0 + allowed.shape[1])
        up[j[j > 0]] = allowed[j[j > 0] - 1, j[j > 0] - c0]
        down[j[j < s - 1]] = allowed[j[j < s - 1] + 1, j[j < s - 1] - c0]
    # a document starts where a row sees neither its left neighbour nor is seen from above
    starts = [0] + [j for j in range(1, s) if not down[j - 1] and not up[j]]
    bounds = [*starts, s]
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    doc = np.repeat(np.arange(len(lengths)), lengths)
    rows = np.arange(s)[:, None]
    for causal in (True, False):
        for c0, allowed in _dense_columns(mask):
            cols = np.arange(c0, c0 + allowed.shape[1])[None, :]
            want = doc[rows] == doc[cols]
            if causal:
                want &= rows >= cols
            if not np.array_equal(allowed, want):
                break
        else:
            return {"lengths": lengths, "causal": causal}
    return None


class _Memory:
    """Peak-memory growth since `start()`: process peak RSS on CPU, CUDA allocator on GPU."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.base = 0.0

    def _cuda(self):
        import paddle

        return paddle.device.cuda

    def peak(self) -> float:
        if self.gpu:
            cuda = self._cuda()
            cuda.synchronize()
            return cuda.max_memory_allocated() / 2**20
        return _rss_mb()

    def current(self) -> float:
        if self.gpu:
            return self._cuda().memory_allocated() / 2**20
        return _current_rss_mb()

    def start(self) -> None:
        if self.gpu:
            cuda = self._cuda()
            cuda.synchronize()
            cuda.reset_max_memory_allocated()
            self.base = cuda.memory_allocated() / 2**20
        else:
            self.base = _rss_mb()


# ------------------------------------------------------------------------------------ worker


def _tile_gemm_timer(args: argparse.Namespace, gpu: bool, dtype: str) -> Callable[[], dict]:
    """A function timing GEMM_CALLS batched tile GEMMs of shapes A and B (seconds per call)."""
    import numpy as np

    h, bq, bk, d = args.heads, args.block_q, args.block_k, args.head_dim
    rng = np.random.default_rng(1)
    shapes = {"A": ((h, bq, d), (h, d, bk)), "B": ((h, bq, bk), (h, bk, d))}
    if gpu:
        import paddle

        operands = {
            k: tuple(paddle.to_tensor(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
                     for s in shp)
            for k, shp in shapes.items()
        }  # fmt: skip

        def matmul(a: Any, b: Any) -> Any:
            return paddle.matmul(a, b)

        sync = paddle.device.cuda.synchronize
    else:
        from flashcp.kernels.numpy_bridge import matmul as kernel_matmul

        cpu = {k: tuple(rng.standard_normal(s, dtype=np.float32) for s in shp)
               for k, shp in shapes.items()}  # fmt: skip
        # The kernel's GEMM engine (Paddle's CPU matmul through `numpy_bridge`), and numpy's own
        # matmul at the same shapes beside it: the engine comparison the kernel's choice rests on.
        operands = {**cpu, **{f"numpy_{k}": ab for k, ab in cpu.items()}}
        matmul = kernel_matmul

        def sync() -> None:
            return None

    def timed() -> dict:
        out = {}
        for name, (a, b) in operands.items():
            mm = np.matmul if name.startswith("numpy_") else matmul
            sync()
            t0 = time.perf_counter()
            for _ in range(GEMM_CALLS):
                mm(a, b)
            sync()
            out[name] = (time.perf_counter() - t0) / GEMM_CALLS
        return out

    return timed


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One (family, S) point: every implementation, interleaved over the rounds."""
    import numpy as np
    import paddle

    gpu = args.device == "gpu"
    if gpu:
        paddle.set_device("gpu")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    sync = paddle.device.cuda.synchronize if gpu else (lambda: None)

    S, H, D = args.seq_len, args.heads, args.head_dim
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, S, H, D), dtype=np.float32) for _ in range(4)]

    def tensor(a: Any, grad: bool) -> Any:
        t = paddle.to_tensor(a)
        if dtype != "float32":
            t = t.astype(dtype)
        t.stop_gradient = not grad
        return t

    q, k, v = (tensor(a, True) for a in arrays[:3])
    dout = tensor(arrays[3], False)
    del arrays
    mask = build_mask(args.family, S, H, args.seed)
    memory = _Memory(gpu)
    memory.start()

    from flashcp.kernels.cpu_reference import CpuReferenceBackend

    idx = paddle.to_tensor(mask.indices)
    planner = CpuReferenceBackend(
        block_q=args.block_q, block_k=args.block_k, max_merge_cols=args.max_merge_cols
    )
    stats = planner.plan(mask.indices, batch=1, q_len=S, k_len=S, causal=mask.causal).stats()
    active_tile_heads = (stats["partial"] + stats["full"]) * (H // mask.indices.shape[1])
    impls: dict[str, Callable[[], Any]] = {}
    if gpu:
        from flashcp import fa_dispatch
        from flashcp.attention.flashmask import flashmask_attention

        fa_version = fa_dispatch.resolve_current(D).version
        impls["flashcp"] = lambda: flashmask_attention(q, k, v, idx, causal=mask.causal)
    else:
        from flashcp.attention.flashmask import flashmask_attention_with_version
        from flashcp.kernels import registry

        registry._instances[registry.CPU_BACKEND] = planner
        fa_version = 2
        impls["flashcp"] = lambda: flashmask_attention_with_version(
            q, k, v, idx, causal=mask.causal, fa_version=2
        )

    import paddle.nn.functional as F

    dense: list[Any] = []  # built just before SDPA's first run, so it counts against SDPA

    def build_dense() -> None:
        bias = paddle.to_tensor(dense_bias(mask))
        dense.append(bias if dtype == "float32" else bias.astype(dtype))

    if "sdpa" in args.impls:
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense[0])
    docs = json.loads(args.documents) if args.documents else None
    if "varlen" in args.impls and docs:
        bounds = np.cumsum([0, *docs["lengths"]]).tolist()

        def varlen() -> Any:
            outs = [
                F.scaled_dot_product_attention(
                    q[:, a:b], k[:, a:b], v[:, a:b], is_causal=docs["causal"]
                )
                for a, b in zip(bounds, bounds[1:], strict=False)
            ]
            return paddle.concat(outs, axis=1)

        impls["varlen"] = varlen
    gemm = _tile_gemm_timer(args, gpu, dtype)

    def step(fwd: Callable[[], Any]) -> tuple[Any, float, float]:
        for t in (q, k, v):
            t.clear_gradient()
        sync()
        t0 = time.perf_counter()
        out = fwd()
        sync()
        t1 = time.perf_counter()
        out.backward(dout)
        sync()
        t2 = time.perf_counter()
        return out, t1 - t0, t2 - t1

    names = list(impls)
    results: dict[str, dict[str, Any]] = {
        n: {"fwd_s": [], "bwd_s": [], "total_s": [], "peak_mem_growth_mb": None} for n in names
    }
    bound: dict[str, list[float]] = {
        "fwd_s": [], "bwd_s": [], "total_s": [], "gflops": [], "numpy_gflops": []
    }  # fmt: skip
    orders = []
    flops_tile = 2 * args.block_q * args.block_k * D  # one A or B GEMM, one head
    for rnd in rounds.interleave(names, args.rounds, warmup=args.warmup):
        round_, order, timed = rnd.index, rnd.order, rnd.timed
        if timed:
            orders.append(order)
        for name in order:
            peak0, cur0 = memory.peak(), memory.current()
            if name == "sdpa" and not dense:
                build_dense()
            out, tf, tb = step(impls[name])
            rec = results[name]
            if round_ == 0:  # memory: each implementation's first run
                peak1 = memory.peak()
                if name == "flashcp" and order[0] == "flashcp":
                    rec["peak_mem_growth_mb"] = peak1 - memory.base
                elif name == "sdpa" and peak1 > peak0:
                    rec["peak_mem_growth_mb"] = peak1 - cur0
            if timed:
                rec["fwd_s"].append(tf)
                rec["bwd_s"].append(tb)
                rec["total_s"].append(tf + tb)
            if round_ == args.warmup + args.rounds - 1:
                o = out.astype("float32").numpy()
                g = q.grad.astype("float32").numpy()
                rec["checksum"] = float(o.sum(dtype=np.float64) + g.sum(dtype=np.float64))
                rec["abs_checksum"] = float(
                    np.abs(o).sum(dtype=np.float64) + np.abs(g).sum(dtype=np.float64)
                )
            del out
        per_call = gemm()
        if timed:
            per_head = {key: t / H for key, t in per_call.items()}
            fwd = active_tile_heads * (per_head["A"] + per_head["B"])
            bwd = active_tile_heads * (2 * per_head["A"] + 3 * per_head["B"])
            bound["fwd_s"].append(fwd)
            bound["bwd_s"].append(bwd)
            bound["total_s"].append(fwd + bwd)
            bound["gflops"].append(2 * flops_tile / (per_head["A"] + per_head["B"]) / 1e9)
            if "numpy_A" in per_head:
                numpy_s = per_head["numpy_A"] + per_head["numpy_B"]
                bound["numpy_gflops"].append(2 * flops_tile / numpy_s / 1e9)
    return {
        "family": args.family,
        "seq_len": S,
        "device": args.device,
        "dtype": dtype,
        "causal": mask.causal,
        "mask_shape": list(mask.indices.shape),
        "fa_version": fa_version,
        "tiles": stats,
        "active_tile_heads": int(active_tile_heads),
        "documents": None if docs is None else len(docs["lengths"]),
        "impls": results,
        "bound": bound,
        "orders": orders,
    }


def _run_point(
    args: argparse.Namespace, family: str, seq_len: int, impls: list[str]
) -> dict[str, Any]:
    """One point in a fresh subprocess; the machine's load average around it is recorded."""
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(args.threads)
    docs = None
    if "varlen" in impls:
        docs = document_segments(build_mask(family, seq_len, args.heads, args.seed))
        if docs is None:
            impls = [i for i in impls if i != "varlen"]
    cmd = [sys.executable, str(ENTRY), "--worker", "--family", family, "--seq-len", str(seq_len)]
    cmd += ["--device", args.device, "--seed", str(args.seed), "--impls", ",".join(impls)]
    for opt in ("heads", "head_dim", "rounds", "warmup", "block_q", "block_k", "max_merge_cols"):
        cmd += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if docs is not None:
        cmd += ["--documents", json.dumps(docs)]
    t0 = time.perf_counter()
    with machine.load_window() as window:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    load = window.as_dict()
    if proc.returncode != 0:
        err = proc.stderr.strip()[-2000:] or f"exit code {proc.returncode}"
        return {"family": family, "seq_len": seq_len, "error": err, **load}
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**rec, **load, "seconds": round(time.perf_counter() - t0, 2)}


def _machine(device: str) -> dict[str, Any]:
    import numpy as np
    import paddle

    info: dict[str, Any] = {
        "cpu": machine.cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "paddle": paddle.__version__,
    }
    if device == "gpu":
        cuda = paddle.device.cuda
        info["gpu"] = cuda.get_device_name()
        info["gpu_capability"] = ".".join(str(x) for x in cuda.get_device_capability())
        info["cuda"] = paddle.version.cuda()
    return info


# ------------------------------------------------------------------------------------ summary


def _tile_fractions(tiles: dict[str, int]) -> dict[str, float]:
    total = sum(tiles.values())
    return {k: v / total for k, v in tiles.items()} if total else {}


def _check_diff(f: dict[str, Any] | None, d: dict[str, Any] | None) -> float | None:
    """|checksum difference| relative to the absolute checksum (sum |out| + sum |dq|)."""
    if not f or not d or not d.get("abs_checksum") or "checksum" not in f:
        return None
    return abs(f["checksum"] - d["checksum"]) / d["abs_checksum"]


def summarize_point(rec: dict[str, Any]) -> dict[str, Any]:
    """Medians, spreads and per-round ratios of one point."""
    impls = rec["impls"]
    fc = impls["flashcp"]["total_s"]
    out: dict[str, Any] = {
        "tile_fractions": _tile_fractions(rec["tiles"]),
        "time": {name: stats.spread(r["total_s"]) for name, r in impls.items()},
        "fwd": {name: stats.spread(r["fwd_s"]) for name, r in impls.items()},
        "bwd": {name: stats.spread(r["bwd_s"]) for name, r in impls.items()},
        "bound": {key: stats.spread(rec["bound"][key]) for key in ("fwd_s", "bwd_s", "total_s")},
        "gemm_gflops": stats.spread(rec["bound"]["gflops"]),
        "numpy_gemm_ratio": stats.spread(
            stats.ratios(rec["bound"]["gflops"], rec["bound"]["numpy_gflops"])
            if rec["bound"].get("numpy_gflops")
            else []
        ),
        "speedup": None,
        "speedup_range": None,
        "varlen_ratio": None,
        "varlen_ratio_range": None,
        "pct_of_bound": stats.spread([100 * x for x in stats.ratios(rec["bound"]["total_s"], fc)]),
        "checksum_rel_diff": {
            name: _check_diff(impls["flashcp"], r) for name, r in impls.items() if name != "flashcp"
        },
        "memory_mb": {name: r.get("peak_mem_growth_mb") for name, r in impls.items()},
    }
    for name, key in (("sdpa", "speedup"), ("varlen", "varlen_ratio")):
        if name in impls:
            st = stats.spread(stats.ratios(impls[name]["total_s"], fc))
            out[key] = st["median"] if st else None
            out[key + "_range"] = [st["min"], st["max"]] if st else None
    return out


def summarize(results: list[dict[str, Any]], headline: str) -> dict[str, Any]:
    """Per-family per-S summaries, the target check and the headline's memory scaling."""
    ok = [r for r in results if "error" not in r]
    families: dict[str, dict[str, Any]] = {}
    for rec in ok:
        families.setdefault(rec["family"], {})[str(rec["seq_len"])] = summarize_point(rec)
    head = families.get(headline, {})
    target = head.get(str(TARGET_SEQ), {}).get("speedup")
    mem = [
        (int(s), row["memory_mb"].get("flashcp"))
        for s, row in sorted(head.items(), key=lambda kv: int(kv[0]))
        if row["memory_mb"].get("flashcp") is not None
    ]
    ratios = [
        b / a if a > 0 else None
        for (sa, a), (sb, b) in zip(mem, mem[1:], strict=False)
        if sb == 2 * sa
    ]
    return {
        "headline_family": headline,
        "target": {
            "seq_len": TARGET_SEQ,
            "min_speedup": TARGET_SPEEDUP,
            "speedup": target,
            "met": None if target is None else target >= TARGET_SPEEDUP,
        },
        "flashcp_peak_mem_mb": {str(s): m for s, m in mem},
        "flashcp_peak_mem_ratio_per_doubling": ratios,
        "families": families,
        "errors": [f"{r['family']}/S={r['seq_len']}" for r in results if "error" in r],
    }


# ------------------------------------------------------------------------------------ the page


def view(report: dict[str, Any]) -> dict[str, Any]:
    """The page's derived figures: rows in S order, per-S speed-ups, the load range."""
    summary, results = report["summary"], report["results"]
    headline = summary["headline_family"]
    points = {(r["family"], r["seq_len"]): r for r in results if "error" not in r}

    def by_seq(rows: dict[str, Any]) -> list[tuple[str, Any]]:
        return sorted(rows.items(), key=lambda kv: int(kv[0]))

    speedups: dict[int, list[float]] = {}
    for fam, rows in summary["families"].items():
        for s, row in rows.items():
            if fam != headline and row["speedup"] is not None:
                speedups.setdefault(int(s), []).append(row["speedup"])
    rows = [row for fam in summary["families"].values() for row in fam.values()]
    return {
        "gpu": report["workload"]["device"] == "gpu",
        "headline": headline,
        "head": summary["families"].get(headline, {}),
        "head_rows": by_seq(summary["families"].get(headline, {})),
        "family_rows": [
            (fam, s, row, points[(fam, int(s))])
            for fam, rows in summary["families"].items()
            for s, row in by_seq(rows)
        ],
        "loads": [
            r[k][0] for r in results for k in ("loadavg_before", "loadavg_after") if r.get(k)
        ],
        "speedups_by_s": sorted(speedups.items()),
        "pct_of_bound": [row["pct_of_bound"]["median"] for row in rows if row["pct_of_bound"]],
        "checksum_diffs": [
            d for row in rows for d in row["checksum_rel_diff"].values() if d is not None
        ],
        "full_seq": FULL_SEQ,
    }


PAGE = Page("kernel.md.j2", DOCS / "bench_kernel.json", view=view, indent=1)
"""`docs/bench_kernel.md`, from `docs/bench_kernel.json` alone."""


# -------------------------------------------------------------------------------------- main


def _lens(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def plan_points(args: argparse.Namespace, families: list[str]) -> list[tuple[str, int, list]]:
    """(family, S, implementations) for every point to run, in order."""
    headline = headline_name(args.docs)
    points = []
    for fam in families:
        lens = set(_lens(args.seq_lens))
        if fam == headline:
            lens |= set(_lens(args.headline_seq_lens))
        if args.full:
            lens.add(FULL_SEQ)
        for s in sorted(lens):
            impls = [i for i in IMPLS if i != "sdpa" or s <= args.sdpa_max_seq]
            points.append((fam, s, impls))
    return points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--families",
        default=None,
        help="comma-separated mask families (default: causal_document_<docs>docs, then every "
        "flashcp.mask_families.FAMILIES entry)",
    )
    p.add_argument("--seq-lens", default="2048", help="S values for every family")
    p.add_argument(
        "--headline-seq-lens",
        default="4096,8192,16384",
        help="extra S values for the headline causal_document_<docs>docs family",
    )
    p.add_argument("--full", action="store_true", help=f"also run every family at S={FULL_SEQ}")
    p.add_argument("--sdpa-max-seq", type=int, default=8192, help="largest S run with SDPA")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument(
        "--dtype", default=None, help="q/k/v dtype (default: float32 on cpu, bfloat16 on gpu)"
    )
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--docs", type=int, default=8, help="documents in the headline mask")
    p.add_argument("--seed", type=int, default=0, help="seed of the FAMILIES generators")
    p.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds per point")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per point")
    p.add_argument("--threads", type=int, default=1, help="OMP/OpenBLAS/MKL threads per run")
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--max-merge-cols", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="smoke: 2 families at S = 512 / 1024")
    PAGE.add_arguments(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impls", default=",".join(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--documents", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")

    if args.worker:
        args.impls = [i for i in args.impls.split(",") if i]
        print(json.dumps(worker(args)))
        return 0

    if args.report_only:
        return PAGE.rewrite(args)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    headline = headline_name(args.docs)
    known = [headline, *family_names()]
    families = known if args.families is None else [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in known and not HEADLINE_RE.match(f)]
    if bad:
        p.error(f"unknown families {bad}; choose from {', '.join(known)}")
    if args.device == "gpu":
        import paddle

        if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0):
            why = "sees no GPU" if paddle.is_compiled_with_cuda() else "is a CPU build"
            p.error(
                "--device gpu needs paddlepaddle-gpu and a visible CUDA GPU; "
                f"this Paddle ({paddle.__version__}) {why}"
            )
    points = plan_points(args, families)
    results = []
    t_start = time.perf_counter()
    for n, (fam, s, impls) in enumerate(points, 1):
        rec = _run_point(args, fam, s, impls)
        results.append(rec)
        if "error" in rec:
            shown = "ERROR " + rec["error"].splitlines()[-1]
        else:
            shown = ", ".join(
                f"{name} {stats.median(r['total_s']):.2f}s" for name, r in rec["impls"].items()
            )
            shown += f", bound {stats.median(rec['bound']['total_s']):.2f}s"
        elapsed = time.perf_counter() - t_start
        print(f"[{n}/{len(points)} {elapsed:6.0f}s] {fam:24s} S={s:6d}: {shown}", flush=True)
    gpu = args.device == "gpu"
    report: dict[str, Any] = {
        "command": " ".join(["python scripts/bench_kernel.py", *(argv or sys.argv[1:])]),
        "seconds": round(time.perf_counter() - t_start, 1),
        "workload": {
            "device": args.device,
            "families": families,
            "headline": f"{headline}: causal document mask, {args.docs} equal documents",
            "family_seed": args.seed,
            "batch": 1,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype or ("bfloat16" if gpu else "float32"),
            "threads": args.threads,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "full": args.full,
            "sdpa_max_seq": args.sdpa_max_seq,
            "memory": "growth of paddle.device.cuda.max_memory_allocated()"
            if gpu
            else "growth of the process's peak RSS (ru_maxrss)",
            "flashcp": "`flashcp.attention.flashmask_attention` (dispatched FA version)"
            if gpu
            else "`flashcp.attention.flashmask_attention_with_version(fa_version=2)`, CPU kernel",
            "flashcp_blocks": {
                "block_q": args.block_q,
                "block_k": args.block_k,
                "max_merge_cols": args.max_merge_cols,
            },
            "gemm_calls_per_shape_and_round": GEMM_CALLS,
        },
        "machine": _machine(args.device),
        "results": results,
    }
    report["summary"] = summarize(results, headline)
    print()
    print(PAGE.write(args, report))
    return 1 if report["summary"]["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
