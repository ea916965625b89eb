"""What activation offload (`train.offload_activations`) and a bf16 residual stream
(`model.residual_dtype`) save, from Paddle's allocator, at several sequence lengths.

One micro-batch of one sequence through a reduced-width GLM-4 (`small_glm`: hidden 256, 4
layers, by default) under full recompute: forward, chunked LM loss, backward. For each length,
residual dtype, training mode (`full`: every weight trains; `frozen`: the weights take no
gradient, as a LoRA base, so no parameter gradient accumulates during backward) and offload
off / on, the row holds:

* `held_after_forward`: allocator bytes held between the forward pass and backward (what
  autograd keeps: without offload the layer inputs, with offload not);
* `peak`: the allocator peak of the whole pass, above the bytes held before it;
* `host_peak`: the most bytes the offload held on the host (counted at the copy,
  `flashcp.models.offload.offload_stats`), and `offloaded`: the bytes copied out.

Per-token slopes between the shortest and the longest length are printed with the rows (the
numbers a memory plan's per-token items are checked against). Allocator counts are exact
tensor bytes (numpy buffers, where the CPU offload keeps its copies, are outside them), so one
run per row is enough.

    python scripts/bench_offload_memory.py                      # 1024 2048 4096 tokens
    python scripts/bench_offload_memory.py --lengths 2048 8192 --layers 8 --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def measure(
    name: str, layers: int, seq: int, residual: str, mode: str, offload: bool, chunk: int
) -> dict[str, Any]:
    """One forward + loss + backward; the allocator's and the offload counters' numbers."""
    import gc

    import numpy as np
    import paddle

    from flashcp import masks
    from flashcp.attention.context import AttentionContext
    from flashcp.metrics import memory
    from flashcp.models import build_model, preset
    from flashcp.models.offload import (
        apply_activation_offload,
        offload_stats,
        reset_offload_stats,
    )

    paddle.set_device("cpu")
    args = preset(
        name, num_layers=layers, max_seq_len=seq, recompute="full", residual_dtype=residual
    )
    model = build_model(args, seed=0)
    if mode == "frozen":
        for p in model.parameters():
            p.stop_gradient = True
    apply_activation_offload(model, offload)
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, args.vocab_size, (1, seq)), dtype="int64")
    labels = paddle.to_tensor(rng.integers(0, args.vocab_size, (1, seq)), dtype="int64")
    pos = paddle.arange(seq, dtype="int64").unsqueeze(0)
    ctx = AttentionContext(mask=masks.causal_document_mask([seq], batch=1).indices, causal=True)
    gc.collect()
    reset_offload_stats()
    start = memory.allocated_bytes()
    memory.reset_peak()
    hidden = model(ids, pos, ctx)
    loss = -model.token_logprobs(hidden, labels, chunk_tokens=chunk).sum() / seq
    del hidden
    held = memory.allocated_bytes() - start
    if mode == "frozen":  # nothing trains: backward through the layers to the inputs' copy
        loss.stop_gradient = False
    loss.backward()
    peak = memory.peak_bytes() - start
    stats = offload_stats()
    return {
        "seq": seq,
        "residual_dtype": residual,
        "mode": mode,
        "offload": offload,
        "held_after_forward": held,
        "peak": peak,
        "host_peak": stats.host_peak_bytes,
        "offloaded": stats.offloaded_bytes,
    }


def slopes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes per token between the shortest and longest length, per (dtype, mode, offload)."""
    out = []
    keys = sorted({(r["residual_dtype"], r["mode"], r["offload"]) for r in rows})
    for key in keys:
        group = sorted((r for r in rows if (r["residual_dtype"], r["mode"], r["offload"]) == key),
                       key=lambda r: r["seq"])  # fmt: skip
        lo, hi = group[0], group[-1]
        span = hi["seq"] - lo["seq"]
        if span <= 0:
            continue
        out.append(
            {
                "residual_dtype": key[0],
                "mode": key[1],
                "offload": key[2],
                **{
                    f"{field}_per_token": (hi[field] - lo[field]) / span
                    for field in ("held_after_forward", "peak", "host_peak")
                },
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small_glm")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--residual", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=["full", "frozen"])
    parser.add_argument("--chunk", type=int, default=256, help="loss chunk tokens")
    parser.add_argument("--json", action="store_true", help="print rows and slopes as JSON")
    opts = parser.parse_args(argv)
    rows = [
        measure(opts.preset, opts.layers, seq, residual, mode, offload, opts.chunk)
        for residual in opts.residual
        for mode in opts.modes
        for seq in opts.lengths
        for offload in (False, True)
    ]
    result = {
        "preset": opts.preset,
        "layers": opts.layers,
        "rows": rows,
        "slopes": slopes(rows),
    }
    if opts.json:
        print(json.dumps(result, indent=2))
        return 0
    mib = 2.0**20
    print(f"{opts.preset}, {opts.layers} layers, full recompute, one sequence (MiB)")
    print("residual  mode    tokens offload  held_after_fwd    peak  host_peak")
    for r in rows:
        print(
            f"{r['residual_dtype']:9} {r['mode']:7} {r['seq']:6} {str(r['offload']):7} "
            f"{r['held_after_forward'] / mib:14.2f} {r['peak'] / mib:8.2f} "
            f"{r['host_peak'] / mib:10.2f}"
        )
    print("bytes per token (longest - shortest length)")
    for s in result["slopes"]:
        print(
            f"{s['residual_dtype']:9} {s['mode']:7} offload={str(s['offload']):5} "
            f"held {s['held_after_forward_per_token']:9.1f}  peak {s['peak_per_token']:9.1f}  "
            f"host {s['host_peak_per_token']:9.1f}"
        )
    return 0
