"""Benchmark flashcp's FlashMask attention against Paddle's dense-mask SDPA, per mask family.

Workload: B=1, H heads, head_dim D, forward + backward, one mask per family. flashcp runs its
front door (PyLayer included) with the column-wise FlashMask mask; the baseline runs
`paddle.nn.functional.scaled_dot_product_attention` with the same mask as a dense additive
float mask `[1, Hm, S, S]` (0 / -inf) built from `flashcp.masks.to_dense`, then `out.backward`.

Families: every entry of `flashcp.masks.FAMILIES` (one seeded mask each, `--seed`) plus the
headline `causal_document_<docs>docs` (`--docs` equal documents, 1-column `[LTS]`, causal).
Masks whose heads are all identical are passed with one mask head (Hm = 1); per-head families
(`sliding_window_per_head`, `random_eviction`) keep Hm = H. Per family the record also holds the
kernel plan's tile counts (MASKED / PARTIAL / FULL, `block_q x block_k` tiles), i.e. the block
sparsity.

Sequence lengths: every family runs at `--seq-lens` (default 2048, 4096); the headline family also
at `--headline-seq-lens` (default 2048 ... 16384); `--full` adds S = 8192 for every family. SDPA
is skipped above `--sdpa-max-seq` (default 8192: its `[B, H, S, S]` scores need about 26 GB at
S = 16384).

Devices:
  --device cpu (default)  flashcp's CPU reference kernel via
                          `flashmask_attention_with_version(..., fa_version=2)` with the tile
                          sizes given here; float32; peak memory = growth of the process's peak
                          RSS (`ru_maxrss`) over its value once q/k/v/dout exist.
  --device gpu            `flashcp.attention.flashmask_attention` (the version resolved by
                          `flashcp.dispatch`, dispatched to Paddle's FA2/FA3 FlashMask kernels
                          through `flashcp.kernels.registry`) vs SDPA on the GPU; bfloat16 by
                          default; one untimed warm-up run; peak memory = growth of
                          `paddle.device.cuda.max_memory_allocated()` over its value once
                          q/k/v/dout exist.

Every (family, implementation, S) point runs in a fresh subprocess with OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to `--threads` (default 1), so timings and peak
memory are not polluted by earlier runs. The dense mask is built after the memory baseline, so it
counts against SDPA, and the int32 FlashMask mask against flashcp.

Writes `--json` (default docs/bench_kernel.json) and the markdown tables to `--markdown` (default:
the JSON path with `.md`). When that file holds the markers `<!-- BEGIN bench_kernel tables -->`
and `<!-- END bench_kernel tables -->`, only the text between them is replaced; otherwise the
file is written as a standalone report. Exits 1 when any point failed.

Usage:
    python scripts/bench_kernel.py                       # default CPU sweep, rewrites docs/
    python scripts/bench_kernel.py --full                # + every family at S = 8192
    python scripts/bench_kernel.py --families causal --seq-lens 1024 --headline-seq-lens '' \\
        --repeats 1 --json /tmp/bench_smoke.json         # smoke
    python scripts/bench_kernel.py --device gpu --json build/bench_kernel_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "docs" / "bench_kernel.json"
IMPLS = ("flashcp", "sdpa")
DEVICES = ("cpu", "gpu")
FULL_SEQ = 8192
TARGET_SEQ = 8192
TARGET_SPEEDUP = 5.0
BEGIN_MARK = "<!-- BEGIN bench_kernel tables -->"
END_MARK = "<!-- END bench_kernel tables -->"
HEADLINE_RE = re.compile(r"^causal_document_(\d+)docs$")


def headline_name(docs: int) -> str:
    return f"causal_document_{docs}docs"


def family_names() -> list[str]:
    from flashcp import masks

    return list(masks.FAMILIES)


def _rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build_mask(family: str, seq_len: int, heads: int, seed: int):
    """The `flashcp.masks.Mask` of `family` for B = 1, with Hm = 1 when all heads agree."""
    import numpy as np

    from flashcp import masks

    m = HEADLINE_RE.match(family)
    if m:
        docs = int(m.group(1))
        bounds = np.linspace(0, seq_len, docs + 1).astype(np.int64)
        return masks.causal_document_mask([int(n) for n in np.diff(bounds)])
    if family not in masks.FAMILIES:
        raise ValueError(f"unknown mask family {family!r}")
    mask = masks.FAMILIES[family](1, seq_len, heads, seed)
    idx = mask.indices
    if idx.shape[1] > 1 and (idx == idx[:, :1]).all():
        mask = masks.Mask(np.ascontiguousarray(idx[:, :1]), mask.causal)
    return mask


def dense_bias(mask: Any):
    """The additive float32 mask `[1, Hm, S, S]`: -inf where `to_dense` says masked, else 0."""
    import numpy as np

    from flashcp import masks

    masked = masks.to_dense(mask.indices, causal=mask.causal)
    return np.where(masked, np.float32(-np.inf), np.float32(0.0))


class _Memory:
    """Peak-memory growth since `start()`: process peak RSS on CPU, CUDA allocator on GPU."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.base = 0.0

    def _cuda(self):
        import paddle

        return paddle.device.cuda

    def start(self) -> None:
        if self.gpu:
            cuda = self._cuda()
            cuda.synchronize()
            cuda.reset_max_memory_allocated()
            self.base = cuda.memory_allocated() / 2**20
        else:
            self.base = _rss_mb()

    def growth_mb(self) -> float:
        if self.gpu:
            cuda = self._cuda()
            cuda.synchronize()
            return cuda.max_memory_allocated() / 2**20 - self.base
        return _rss_mb() - self.base


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One (family, impl, S) measurement in this process; returns a JSON-able record."""
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

    stats: dict[str, int] = {}
    fa_version = None
    if args.impl == "flashcp":
        from flashcp.kernels.cpu_reference import CpuReferenceBackend

        idx = paddle.to_tensor(mask.indices)
        planner = CpuReferenceBackend(
            block_q=args.block_q, block_k=args.block_k, max_merge_cols=args.max_merge_cols
        )
        stats = planner.plan(mask.indices, batch=1, q_len=S, k_len=S, causal=mask.causal).stats()
        if gpu:
            from flashcp import dispatch
            from flashcp.attention import flashmask_attention

            fa_version = dispatch.resolve_current(D).version

            def fwd():
                return flashmask_attention(q, k, v, idx, causal=mask.causal)

        else:
            from flashcp.attention import flashmask_attention_with_version
            from flashcp.kernels import registry

            registry._instances[registry.CPU_BACKEND] = planner
            fa_version = 2

            def fwd():
                return flashmask_attention_with_version(
                    q, k, v, idx, causal=mask.causal, fa_version=2
                )

    else:
        import paddle.nn.functional as F

        bias_np = dense_bias(mask)
        bias = paddle.to_tensor(bias_np)
        del bias_np
        if dtype != "float32":
            bias = bias.astype(dtype)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def step() -> tuple[Any, float, float]:
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

    if gpu:  # CUDA context, cuBLAS handles and kernel loading stay out of the timings
        step()
    fwd_times, bwd_times = [], []
    out = None
    for _ in range(args.repeats):
        out = None  # free the previous output before the next forward
        out, tf, tb = step()
        fwd_times.append(tf)
        bwd_times.append(tb)
    peak = memory.growth_mb()  # read before the checksum copies below
    o = out.astype("float32").numpy()
    g = q.grad.astype("float32").numpy()
    return {
        "family": args.family,
        "impl": args.impl,
        "seq_len": S,
        "device": args.device,
        "dtype": dtype,
        "causal": mask.causal,
        "mask_shape": list(mask.indices.shape),
        "fa_version": fa_version,
        "fwd_s": min(fwd_times),
        "bwd_s": min(bwd_times),
        "total_s": min(f + b for f, b in zip(fwd_times, bwd_times, strict=True)),
        "all_fwd_s": fwd_times,
        "all_bwd_s": bwd_times,
        "peak_mem_growth_mb": peak,
        "tiles": stats,
        "checksum": float(o.sum(dtype=np.float64) + g.sum(dtype=np.float64)),
        "abs_checksum": float(np.abs(o).sum(dtype=np.float64) + np.abs(g).sum(dtype=np.float64)),
    }


def _run_point(args: argparse.Namespace, family: str, impl: str, seq_len: int) -> dict[str, Any]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(args.threads)
    cmd = [sys.executable, __file__, "--worker", "--family", family, "--impl", impl]
    cmd += ["--seq-len", str(seq_len), "--device", args.device, "--seed", str(args.seed)]
    for opt in ("heads", "head_dim", "repeats", "block_q", "block_k", "max_merge_cols"):
        cmd += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        err = proc.stderr.strip()[-2000:] or f"exit code {proc.returncode}"
        return {"family": family, "impl": impl, "seq_len": seq_len, "error": err}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine(device: str) -> dict[str, Any]:
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
    info: dict[str, Any] = {
        "cpu": cpu,
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


# ------------------------------------------------------------------------------------ report


def _ok(results: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["family"], r["impl"], r["seq_len"]): r for r in results if "error" not in r}


def _tile_fractions(tiles: dict[str, int]) -> dict[str, float]:
    total = sum(tiles.values())
    return {k: v / total for k, v in tiles.items()} if total else {}


def _speedup(f: dict[str, Any] | None, d: dict[str, Any] | None) -> float | None:
    return d["total_s"] / f["total_s"] if f and d and f["total_s"] > 0 else None


def _check_diff(f: dict[str, Any] | None, d: dict[str, Any] | None) -> float | None:
    """|checksum difference| relative to the absolute checksum (sum |out| + sum |dq|)."""
    if not f or not d or not d.get("abs_checksum"):
        return None
    return abs(f["checksum"] - d["checksum"]) / d["abs_checksum"]


def summarize(results: list[dict[str, Any]], headline: str) -> dict[str, Any]:
    """Per-family speed-ups and sparsity, the S = 8192 target and the memory scaling."""
    ok = _ok(results)
    families = list(dict.fromkeys(r["family"] for r in results))
    per_family: dict[str, Any] = {}
    for fam in families:
        rows = {}
        for s in sorted({r["seq_len"] for r in results if r["family"] == fam}):
            f, d = ok.get((fam, "flashcp", s)), ok.get((fam, "sdpa", s))
            rows[str(s)] = {
                "speedup": _speedup(f, d),
                "tile_fractions": _tile_fractions(f["tiles"]) if f else {},
                "checksum_rel_diff": _check_diff(f, d),
            }
        per_family[fam] = rows
    head = per_family.get(headline, {})
    target = head.get(str(TARGET_SEQ), {}).get("speedup")
    mem = [
        (s, ok[(headline, "flashcp", s)]["peak_mem_growth_mb"])
        for s in sorted(int(x) for x in head)
        if (headline, "flashcp", s) in ok
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
        "families": per_family,
        "errors": [f"{r['family']}/{r['impl']}/S={r['seq_len']}" for r in results if "error" in r],
    }


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _tiles_cell(tiles: dict[str, int]) -> str:
    fr = _tile_fractions(tiles)
    if not fr:
        return "-"
    return " / ".join(f"{100 * fr[k]:.1f}" for k in ("masked", "partial", "full"))


def _mask_cell(r: dict[str, Any]) -> str:
    _, hm, _, c = r["mask_shape"]
    return f"{'causal' if r['causal'] else 'non-causal'}, C={c}" + (f", Hm={hm}" if hm > 1 else "")


def markdown(report: dict[str, Any]) -> str:
    """The results tables (headline and per family) plus the generated summary lines."""
    results, summary = report["results"], report["summary"]
    headline = summary["headline_family"]
    ok = _ok(results)
    mem = "peak GPU memory growth" if report["workload"]["device"] == "gpu" else "peak RSS growth"
    lines = [
        f"Machine: {_machine_line(report['machine'], report['workload'])}",
        "",
    ]
    if any(r["family"] == headline for r in results):
        lines += [
            f"### Headline: `{headline}`",
            "",
            f"| S | tiles masked / partial / full (%) | flashcp fwd (s) | flashcp bwd (s) "
            f"| flashcp fwd+bwd (s) | flashcp {mem} (MiB) | SDPA fwd+bwd (s) "
            f"| SDPA {mem} (MiB) | speed-up |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in sorted({r["seq_len"] for r in results if r["family"] == headline}):
            f, d = ok.get((headline, "flashcp", s)), ok.get((headline, "sdpa", s))
            row = [str(s), _tiles_cell(f["tiles"]) if f else "-"]
            if f:
                row += [f"{f['fwd_s']:.2f}", f"{f['bwd_s']:.2f}", f"{f['total_s']:.2f}"]
                row.append(f"{f['peak_mem_growth_mb']:.0f}")
            else:
                row += ["-"] * 4
            row += [f"{d['total_s']:.2f}", f"{d['peak_mem_growth_mb']:.0f}"] if d else ["-", "-"]
            sp = _speedup(f, d)
            cell = _fmt(sp, ".1f", "x")
            row.append(f"**{cell}**" if s == TARGET_SEQ and sp is not None else cell)
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "### Every family",
        "",
        f"| family | mask | S | tiles masked / partial / full (%) | flashcp fwd+bwd (s) "
        f"| flashcp {mem} (MiB) | SDPA fwd+bwd (s) | SDPA {mem} (MiB) | speed-up "
        "| checksum rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in summary["families"]:
        for s in sorted(int(x) for x in summary["families"][fam]):
            f, d = ok.get((fam, "flashcp", s)), ok.get((fam, "sdpa", s))
            any_rec = f or d
            row = [f"`{fam}`", _mask_cell(any_rec) if any_rec else "-", str(s)]
            row.append(_tiles_cell(f["tiles"]) if f else "-")
            row += [f"{f['total_s']:.2f}", f"{f['peak_mem_growth_mb']:.0f}"] if f else ["-", "-"]
            row += [f"{d['total_s']:.2f}", f"{d['peak_mem_growth_mb']:.0f}"] if d else ["-", "-"]
            row += [_fmt(_speedup(f, d), ".1f", "x"), _fmt(_check_diff(f, d), ".1e")]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", *_summary_lines(summary, results)]
    return "\n".join(lines)


def _machine_line(machine: dict[str, Any], workload: dict[str, Any]) -> str:
    parts = [f"{machine['cpu']}, {machine['cores']} cores"]
    if "gpu" in machine:
        parts.append(
            f"GPU {machine['gpu']} (SM {machine['gpu_capability']}, CUDA {machine['cuda']})"
        )
    parts += [f"Python {machine['python']}", f"numpy {machine['numpy']}"]
    parts.append(f"Paddle {machine['paddle']}")
    parts.append(
        f"B=1, H={workload['heads']}, D={workload['head_dim']}, {workload['dtype']}, "
        f"{workload['threads']} thread(s), best of {workload['repeats']}"
    )
    return "; ".join(parts) + "."


def _summary_lines(summary: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    out = []
    t = summary["target"]
    if t["speedup"] is not None:
        verdict = "met" if t["met"] else "NOT met"
        out.append(
            f"* Target (>= {t['min_speedup']:.0f}x on `{summary['headline_family']}` at "
            f"S = {t['seq_len']}): **{verdict}** ({t['speedup']:.1f}x)."
        )
    mem = summary["flashcp_peak_mem_mb"]
    if len(mem) > 1:
        ratios = ", ".join(_fmt(r, ".2f") for r in summary["flashcp_peak_mem_ratio_per_doubling"])
        out.append(
            "* flashcp peak memory on the headline: "
            + ", ".join(f"{m:.0f}" for m in mem.values())
            + f" MiB at S = {', '.join(mem)}; ratio per doubling of S: {ratios} "
            "(2.0 is linear, 4.0 quadratic)."
        )
    by_s: dict[int, list[float]] = {}
    for fam, rows in summary["families"].items():
        if fam == summary["headline_family"]:
            continue
        for s, row in rows.items():
            if row["speedup"] is not None:
                by_s.setdefault(int(s), []).append(row["speedup"])
    for s in sorted(by_s):
        sp = by_s[s]
        out.append(
            f"* Speed-up over the {len(sp)} `FAMILIES` masks at S = {s}: min {min(sp):.1f}x, "
            f"median {statistics.median(sp):.1f}x, max {max(sp):.1f}x."
        )
    diffs = [
        row["checksum_rel_diff"]
        for rows in summary["families"].values()
        for row in rows.values()
        if row["checksum_rel_diff"] is not None
    ]
    if diffs:
        out.append(
            f"* Largest checksum difference flashcp vs SDPA: {max(diffs):.1e} of "
            "sum |out| + sum |dq| (same function computed)."
        )
    if summary["errors"]:
        out.append("* Failed points: " + ", ".join(summary["errors"]) + " (see the JSON).")
    return out


def write_markdown(path: Path, tables: str, report: dict[str, Any], json_path: Path) -> None:
    block = f"{BEGIN_MARK}\n\n{tables}\n\n{END_MARK}"
    if path.exists():
        text = path.read_text()
        if BEGIN_MARK in text and END_MARK in text:
            head, rest = text.split(BEGIN_MARK, 1)
            tail = rest.split(END_MARK, 1)[1]
            path.write_text(head + block + tail)
            return
    wl = report["workload"]
    title = f"# FlashMask kernel benchmark ({wl['device']})"
    intro = (
        f"Generated by `scripts/bench_kernel.py`; raw results in `{json_path.name}`. "
        "flashcp's FlashMask attention vs Paddle's SDPA with the same mask as a dense additive "
        "`[1, Hm, S, S]` tensor, forward + backward; tiles are the kernel plan's "
        f"{wl['flashcp_blocks']['block_q']} x {wl['flashcp_blocks']['block_k']} tiles."
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{title}\n\n{intro}\n\n{block}\n")


# -------------------------------------------------------------------------------------- main


def _lens(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def plan_points(args: argparse.Namespace, families: list[str]) -> list[tuple[str, str, int]]:
    """(family, impl, S) for every point to run, in order."""
    headline = headline_name(args.docs)
    points = []
    for fam in families:
        lens = set(_lens(args.seq_lens))
        if fam == headline:
            lens |= set(_lens(args.headline_seq_lens))
        if args.full:
            lens.add(FULL_SEQ)
        for s in sorted(lens):
            for impl in IMPLS:
                if impl == "sdpa" and s > args.sdpa_max_seq:
                    continue
                points.append((fam, impl, s))
    return points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--families",
        default=None,
        help="comma-separated mask families (default: causal_document_<docs>docs, then every "
        "flashcp.masks.FAMILIES entry)",
    )
    p.add_argument("--seq-lens", default="2048,4096", help="S values for every family")
    p.add_argument(
        "--headline-seq-lens",
        default="2048,4096,8192,16384",
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
    p.add_argument("--repeats", type=int, default=2, help="runs per point (min is reported)")
    p.add_argument("--threads", type=int, default=1, help="OMP/OpenBLAS/MKL threads per run")
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--max-merge-cols", type=int, default=1024)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    p.add_argument(
        "--markdown", type=Path, default=None, help="markdown tables (default: --json with .md)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args)))
        return 0

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
    for n, (fam, impl, s) in enumerate(points, 1):
        rec = _run_point(args, fam, impl, s)
        results.append(rec)
        if "error" in rec:
            shown = "ERROR " + rec["error"].splitlines()[-1]
        else:
            shown = f"fwd {rec['fwd_s']:.2f}s bwd {rec['bwd_s']:.2f}s"
            shown += f" peak {rec['peak_mem_growth_mb']:.0f} MiB"
        elapsed = time.perf_counter() - t_start
        print(
            f"[{n}/{len(points)} {elapsed:6.0f}s] {fam:24s} {impl:8s} S={s:6d}: {shown}", flush=True
        )
    gpu = args.device == "gpu"
    report: dict[str, Any] = {
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
            "repeats": args.repeats,
            "warmup_runs": 1 if gpu else 0,
            "full": args.full,
            "sdpa_max_seq": args.sdpa_max_seq,
            "memory": "growth of paddle.device.cuda.max_memory_allocated()"
            if gpu
            else "growth of the process's peak RSS (ru_maxrss)",
            "flashcp": "flashcp.attention.flashmask_attention (dispatched FA version)"
            if gpu
            else "flashcp.attention.flashmask_attention_with_version(fa_version=2), CPU kernel",
            "flashcp_blocks": {
                "block_q": args.block_q,
                "block_k": args.block_k,
                "max_merge_cols": args.max_merge_cols,
            },
        },
        "machine": _machine(args.device),
        "results": results,
    }
    report["summary"] = summarize(results, headline)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    tables = markdown(report)
    md_path = args.markdown or args.json.with_suffix(".md")
    write_markdown(md_path, tables, report, args.json)
    print()
    print(tables)
    print(f"\nwrote {args.json} and {md_path}")
    return 1 if report["summary"]["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
