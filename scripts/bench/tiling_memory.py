"""Peak memory of a training pass with sequence tiling (`model.tile_tokens`) off and on.

One forward + backward (the chunked LM loss, `train.loss_chunk_tokens` default) of a
reduced-width GLM-4 (`small_glm`: hidden 256, 8/4 heads of 32, fused SwiGLU of 704; 4 layers;
full recompute; batch 1) at several local lengths, once untiled and once per tile size, on one
CPU process. Peak = the allocator's highest tensor bytes above the start of the pass
(`flashcp.metrics.memory.PeakMeter`: Paddle's host allocator statistics, exact bytes of Paddle
tensors); *kept* = what is allocated when the forward has returned (the layers' kept inputs,
the final norm, the rotary tables). Per case the slope per local token is the least-squares
fit of the peak over the lengths, also given in units of the hidden size (float32 elements
per token / H) — the number of full-length H-wide float32 tensors the pass holds at its peak.

What the numbers show: untiled, a layer's backward (the replay under full recompute) holds
every intermediate of all its tokens — the MLP's gate/up/product, the norms, the projections
— so the slope carries the whole layer working set. Tiled, only the full-length tensors remain
(q/k/v, the attention output and LSE, the layer output, the residual-stream gradients and the
attention backward's own tensors; `flashcp.models.tiling`), and one tile's intermediates add a
constant that depends on the tile, not on the length. On CPU the attention backward is the
numpy reference kernel, whose input copies count in the allocator; on GPU FlashAttention holds
its float32 dQ accumulator instead.

Writes `--json` (default docs/tiling_memory.json) and `--markdown` (default: the JSON path
with .md).

Usage:
    python scripts/bench_tiling_memory.py                       # docs/tiling_memory.md
    python scripts/bench_tiling_memory.py --lengths 512,1024 --tiles 64 --json /tmp/t.json
    python scripts/bench_tiling_memory.py --report-only
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import machine
from bench.report import DOCS, Page

DEFAULT_LENGTHS = "2048,4096,8192"
DEFAULT_TILES = "0,256,1024"
MIB = 2**20


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise SystemExit(f"--{what} {text!r} is not a comma-separated list of integers") from err
    if not values or min(values) < 0:
        raise SystemExit(f"--{what} needs integers >= 0, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="local lengths (tokens)")
    p.add_argument("--tiles", default=DEFAULT_TILES, help="model.tile_tokens values (0 = off)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--preset", default="small_glm")
    p.add_argument("--recompute", default="full", choices=("none", "full", "refined"))
    PAGE.add_arguments(p)
    args = p.parse_args(argv)
    args.length_list = _ints(args.lengths, "lengths")
    args.tile_list = _ints(args.tiles, "tiles")
    if len(args.length_list) < 2:
        raise SystemExit("--lengths needs at least two lengths (for the slope)")
    if args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    return args


def one_pass(args: argparse.Namespace, tile: int, length: int) -> dict[str, float]:
    """Forward + backward of the chunked LM loss: peak and kept bytes above the start."""
    import paddle

    from flashcp import masks
    from flashcp.attention.context import AttentionContext
    from flashcp.metrics.memory import PeakMeter, allocated_bytes
    from flashcp.models import build_model, preset

    model_args = preset(
        args.preset,
        recompute=args.recompute,
        tile_tokens=tile,
        num_layers=args.layers,
        max_seq_len=max(length, 2),
    )
    model = build_model(model_args, seed=0)
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, model_args.vocab_size, (1, length)), dtype="int64")
    pos = paddle.arange(length, dtype="int64").unsqueeze(0)
    labels = paddle.concat([ids[:, 1:], paddle.full([1, 1], -100, "int64")], axis=1)
    ctx = AttentionContext(mask=masks.causal_mask(1, length).indices, causal=True)
    with PeakMeter() as meter:
        hidden = model(ids, pos, ctx)
        kept = allocated_bytes() - meter.start_bytes
        loss = -model.token_logprobs(hidden, labels).mean()
        loss.backward()
        del hidden
    return {"peak_bytes": meter.peak_bytes, "kept_bytes": kept, "loss": float(loss)}


def slope(lengths: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares bytes per token of `values` over `lengths`."""
    return float(np.polyfit(np.asarray(lengths, float), np.asarray(values, float), 1)[0])


def view(rec: dict[str, Any]) -> dict[str, Any]:
    """The page's derived figures: the untiled slope and each case's share of it."""
    plain = next((c for c in rec["cases"] if c["tile"] == 0), None)
    return {"plain_slope": None if plain is None else plain["peak_slope"]}


PAGE = Page("tiling_memory.md.j2", DOCS / "tiling_memory.json", view=view)
"""`docs/tiling_memory.md`, from `docs/tiling_memory.json` alone."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return PAGE.rewrite(args)
    import paddle

    from flashcp.models import preset

    paddle.set_device("cpu")
    hidden = preset(args.preset).hidden_size
    cases = []
    with machine.load_window() as load:
        for tile in args.tile_list:
            runs = [one_pass(args, tile, n) for n in args.length_list]
            peaks = [r["peak_bytes"] for r in runs]
            kept = [r["kept_bytes"] for r in runs]
            case = {
                "tile": tile,
                "peak_bytes": peaks,
                "kept_bytes": kept,
                "losses": [r["loss"] for r in runs],
                "peak_slope": slope(args.length_list, peaks),
                "kept_slope": slope(args.length_list, kept),
            }
            case["peak_slope_h"] = case["peak_slope"] / 4 / hidden
            case["kept_slope_h"] = case["kept_slope"] / 4 / hidden
            cases.append(case)
            shown = "  ".join(f"{p / MIB:8.1f}" for p in peaks)
            print(f"tile {tile:>5}: peak MiB {shown}   slope {case['peak_slope']:,.0f} B/token "
                  f"({case['peak_slope_h']:.2f}·H float32)", flush=True)  # fmt: skip
    rec = {
        "preset": args.preset,
        "layers": args.layers,
        "hidden": hidden,
        "recompute": args.recompute,
        "lengths": args.length_list,
        "cases": cases,
        "command": " ".join(["python scripts/bench_tiling_memory.py", *(argv or sys.argv[1:])]),
        "environment": {
            "python": platform.python_version(),
            "paddle": paddle.__version__,
            "cpus": os.cpu_count(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            **load.as_dict(),
        },
    }
    PAGE.write(args, rec)
    return 0
