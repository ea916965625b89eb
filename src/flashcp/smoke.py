"""The quick-start job: context-parallel FlashMask attention on N processes, checked.

Run it under the launcher (`python -m paddle.distributed.launch --nproc_per_node 2
src/flashcp/smoke.py`). Every rank builds the same global q/k/v and a packed-documents
(causal-document) mask, runs dual-chunk all-gather-KV CP attention forward and backward on its
shard (on the GPU when Paddle sees one, else CPU), and compares its output and gradients with
the same attention computed by the CPU reference kernel in float32 on the whole sequence in this
process. Rank 0 prints a summary; a mismatch exits non-zero.

`--dtype auto` (default) runs bfloat16 on a GPU (Paddle's FlashAttention kernels have no
float32) and float32 on CPU. The inputs are rounded to the run's dtype before the reference
sees them, so only the kernel's own arithmetic is measured, against `TOLERANCE[dtype]` times
max(1, max |reference|) of each compared tensor.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import paddle

from flashcp import masks
from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.flashmask import flashmask_attention
from flashcp.attention.registry import DEFAULT_MODE, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    comm_stats,
    init_distributed,
    shutdown,
)

TOLERANCE: dict[str, float] = {
    # float32 on CPU: the same kernel family, different tiling/summation order.
    "float32": 1e-4,
    # bfloat16 on GPU: P and dS are rounded to bf16 (unit roundoff 2^-8 ≈ 3.9e-3) before the
    # second GEMMs and outputs once more; 2.5e-2 ≈ 6.4 ulp, the bound the GPU kernel tests use.
    "bfloat16": 2.5e-2,
}
"""Largest accepted max |CP - reference| per dtype, relative to max(1, max |reference|)."""


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` → bfloat16 on GPU, float32 on CPU; float32 on GPU is refused (no such kernel)."""
    if dtype == "auto":
        return "bfloat16" if device == "gpu" else "float32"
    if dtype == "float32" and device == "gpu":
        raise SystemExit(
            "smoke: --dtype float32 cannot run on a GPU (Paddle's FlashAttention kernels are "
            "float16/bfloat16 only): use --dtype auto or bfloat16"
        )
    if dtype == "bfloat16" and device != "gpu":
        raise SystemExit("smoke: --dtype bfloat16 needs a GPU (no bf16 kernels on CPU)")
    return dtype


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` rounded to `dtype` and back to float32 (what the run actually computes on)."""
    t = paddle.to_tensor(x, place=paddle.CPUPlace())
    return t.astype(dtype).astype("float32").numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max(1, max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def _grads(q, k, v, dout, idx, fn, *, place=None, dtype="float32"):
    """fn's output and q/k/v gradients, computed on `place` in `dtype`, as float32 numpy."""

    def tensor(x):
        return paddle.to_tensor(x, place=place).astype(dtype)

    tq, tk, tv = (tensor(x) for x in (q, k, v))
    for t in (tq, tk, tv):
        t.stop_gradient = False
    out = fn(tq, tk, tv, idx)
    out.backward(tensor(dout))
    return tuple(t.astype("float32").numpy() for t in (out, tq.grad, tk.grad, tv.grad))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="compute dtype of the CP run (auto: bfloat16 on GPU, float32 on CPU)",
    )
    args = parser.parse_args(argv)

    env = init_distributed()
    world = env.world_size
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=world, world_size=world))
    group = groups.cp
    rank = 0 if group is None else group.rank
    seq, hq, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    on_gpu = bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
    dtype = resolve_dtype(args.dtype, "gpu" if on_gpu else "cpu")
    rng = np.random.default_rng(0)
    q, k, v, dout = (
        as_dtype(rng.standard_normal(shape).astype(np.float32), dtype)
        for shape in ((1, seq, hq, d), (1, seq, hkv, d), (1, seq, hkv, d), (1, seq, hq, d))
    )
    cuts = np.sort(rng.choice(np.arange(1, seq), size=args.docs - 1, replace=False))
    doc_lens = np.diff(np.concatenate([[0], cuts, [seq]])).tolist()
    mask = masks.causal_document_mask(doc_lens)

    asg = make_assignment(DEFAULT_MODE, world)
    pos = asg.positions(seq, rank)
    start = time.perf_counter()
    got = _grads(
        *(shard_assigned(x, rank, asg, axis=1) for x in (q, k, v, dout)),
        mask.indices,
        lambda a, b, c, idx: flashmask_attention_cp(a, b, c, idx, group=group, causal=True),
        dtype=dtype,
    )
    cp_time = time.perf_counter() - start
    cpu = paddle.CPUPlace()
    full = _grads(
        q, k, v, dout, mask.indices,
        lambda a, b, c, idx: flashmask_attention(
            a, b, c, paddle.to_tensor(idx, place=cpu), causal=True
        ),
        place=cpu,
    )  # fmt: skip
    # dk/dv of the whole sequence: each rank holds its rows after the reduce-scatter.
    want = (full[0][:, pos], full[1][:, pos], full[2][:, pos], full[3][:, pos])
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    tol = TOLERANCE[dtype]
    ok = max(errors) < tol
    worst = paddle.to_tensor([max(errors)], dtype="float32")
    if group is not None:
        worst = all_reduce_tensor(worst, group)  # sum of per-rank maxima, >= the global max
    sent = comm_stats().sent
    print(
        f"rank {rank}/{world}: tokens {pos.size} of {seq} (chunks {asg.ranks[rank]}), "
        f"max rel. err out/dq/dk/dv = {', '.join(f'{e:.1e}' for e in errors)}, "
        f"CP fwd+bwd {cp_time:.2f}s, sent {sent / 2**20:.2f} MiB",
        flush=True,
    )
    if rank == 0:
        verdict = "OK" if float(worst.numpy()[0]) < tol * world else "MISMATCH"
        print(
            f"flashcp smoke: {world}-way dual-chunk CP FlashMask attention, S={seq}, "
            f"{len(doc_lens)} packed documents, Hq={hq} Hkv={hkv} D={d}, {dtype} (tolerance "
            f"{tol:g}): {verdict} against the single-process kernel",
            flush=True,
        )
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
