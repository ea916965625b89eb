"""Optimizer-state bytes per rank with and without ZeRO-1, measured by Paddle's allocator.

For a model's trainable parameters (one pipeline stage = the whole model here), builds the
optimizer state one rank would hold — `flashcp.optim.master_shard.MasterShard` for shard `index` of
N (float32 masters + both AdamW moments + beta powers), after one AdamW step so every
accumulator exists — and reads `paddle.base.core.host_memory_stat_current_value("Allocated")`
before and after. N = 1 is the unsharded master state (bf16 storage); the last row is the
default float32 path (Paddle's AdamW on the parameters: moments only). Nothing is freed between
measurements (a freed tensor would lower a later delta), and the garbage collector is flushed
before and paused inside each window. Bytes are deterministic: no repeats.

Usage:
    python scripts/zero_memory.py                       # small_glm, N = 1, 2, 4, 8
    python scripts/zero_memory.py --preset tiny_glm_moe --shards 1 4 --json /tmp/zero.json
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from paddle.base import core

from flashcp.config import TrainConfig
from flashcp.models import build_model, preset
from flashcp.optim.adamw import build_adamw, decay_names
from flashcp.optim.layout import shard_layout
from flashcp.optim.master_shard import MasterShard


def allocated() -> int:
    return int(core.host_memory_stat_current_value("Allocated", 0))


def measure(fn: Callable[[], Any], keep: list[Any]) -> int:
    gc.collect()
    gc.disable()
    try:
        before = allocated()
        keep.append(fn())
        return allocated() - before
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small_glm")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = build_model(preset(args.preset))
    params = dict(model.named_parameters())
    sizes = [(n, int(np.prod(p.shape))) for n, p in params.items()]
    total = sum(k for _, k in sizes)
    train = TrainConfig()
    keep: list[Any] = []
    rows = []
    for shards in args.shards:
        for index in sorted({0, shards - 1}):
            lay = shard_layout(sizes, shards, index, int(args.bucket_mb * 2**20) // 4)
            pieces = [paddle.zeros([lay.piece(b)], "float32") for b in range(len(lay.buckets))]
            keep.append(pieces)

            def build(lay: Any = lay, pieces: list[Any] = pieces) -> MasterShard:
                state = MasterShard(lay, params, train, 1e-3)
                for b, piece in enumerate(pieces):
                    state.set_grads(b, piece, None)
                state.step()
                state.clear_grads()
                return state

            got = measure(build, keep)
            rows.append({"shards": shards, "index": index, "owned": lay.owned, "bytes": got})
    unsharded = next(r["bytes"] for r in rows if r["shards"] == 1) if 1 in args.shards else None

    for p in params.values():  # gradients exist before the window: not optimizer state
        p.grad = paddle.zeros_like(p)

    def default() -> Any:
        tensors = list(params.values())
        opt = build_adamw(tensors, TrainConfig(), 1e-3, decay_names(tensors))
        opt.step()
        return opt

    default_bytes = measure(default, keep)
    print(f"{args.preset}: {total:,} trainable elements")
    print(f"{'N':>3} {'shard':>5} {'owned':>12} {'bytes':>14} {'B/elem':>7} {'vs N=1':>7}")
    for r in rows:
        ratio = f"{r['bytes'] / unsharded:.4f}" if unsharded else "-"
        print(f"{r['shards']:>3} {r['index']:>5} {r['owned']:>12,} {r['bytes']:>14,} "
              f"{r['bytes'] / r['owned']:>7.3f} {ratio:>7}")  # fmt: skip
    print(f"default float32 AdamW on the parameters: {default_bytes:,} B "
          f"({default_bytes / total:.3f} B/elem)")  # fmt: skip
    if args.json:
        out = {"preset": args.preset, "elements": total, "rows": rows, "default": default_bytes}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
