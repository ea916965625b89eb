"""The quick-start job: context-parallel FlashMask attention on N processes, checked.

Run it under the launcher (`python -m paddle.distributed.launch --nproc_per_node 2
src/flashcp/smoke.py`). Every rank builds the same global q/k/v and a packed-documents
(causal-document) mask, runs dual-chunk all-gather-KV CP attention forward and backward on its
shard, and compares its output and gradients with the same attention computed by the CPU kernel
on the whole sequence in this process. Rank 0 prints a summary; a mismatch exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import paddle

from flashcp import masks
from flashcp.attention import flashmask_attention
from flashcp.cp import flashmask_attention_cp, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    comm_stats,
    init_distributed,
    shutdown,
)


def _grads(q, k, v, dout, idx, fn):
    tq, tk, tv = (paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v))
    out = fn(tq, tk, tv, idx)
    out.backward(paddle.to_tensor(dout))
    return out.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, default=6)
    args = parser.parse_args(argv)

    env = init_distributed()
    world = env.world_size
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=world, world_size=world))
    group = groups.cp
    rank = 0 if group is None else group.rank
    seq, hq, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seq, hq, d)).astype(np.float32)
    k = rng.standard_normal((1, seq, hkv, d)).astype(np.float32)
    v = rng.standard_normal((1, seq, hkv, d)).astype(np.float32)
    dout = rng.standard_normal((1, seq, hq, d)).astype(np.float32)
    cuts = np.sort(rng.choice(np.arange(1, seq), size=args.docs - 1, replace=False))
    doc_lens = np.diff(np.concatenate([[0], cuts, [seq]])).tolist()
    mask = masks.causal_document_mask(doc_lens)

    asg = make_assignment("dualchunk_allgather", world)
    pos = asg.positions(seq, rank)
    start = time.perf_counter()
    got = _grads(
        *(shard_assigned(x, rank, asg, axis=1) for x in (q, k, v, dout)),
        mask.indices,
        lambda a, b, c, idx: flashmask_attention_cp(a, b, c, idx, group=group, causal=True),
    )
    cp_time = time.perf_counter() - start
    full = _grads(
        q, k, v, dout, mask.indices,
        lambda a, b, c, idx: flashmask_attention(a, b, c, paddle.to_tensor(idx), causal=True),
    )  # fmt: skip
    # dk/dv of the whole sequence: each rank holds its rows after the reduce-scatter.
    want = (full[0][:, pos], full[1][:, pos], full[2][:, pos], full[3][:, pos])
    errors = [float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True)]
    ok = max(errors) < 1e-4
    worst = paddle.to_tensor([max(errors)], dtype="float32")
    if group is not None:
        worst = all_reduce_tensor(worst, group)  # sum of per-rank maxima, >= the global max
    sent = comm_stats().sent
    print(
        f"rank {rank}/{world}: tokens {pos.size} of {seq} (chunks {asg.ranks[rank]}), "
        f"max |err| out/dq/dk/dv = {', '.join(f'{e:.1e}' for e in errors)}, "
        f"CP fwd+bwd {cp_time:.2f}s, sent {sent / 2**20:.2f} MiB",
        flush=True,
    )
    if rank == 0:
        verdict = "OK" if float(worst.numpy()[0]) < 1e-4 * world else "MISMATCH"
        print(
            f"flashcp smoke: {world}-way dual-chunk CP FlashMask attention, S={seq}, "
            f"{len(doc_lens)} packed documents, Hq={hq} Hkv={hkv} D={d}: {verdict} against the "
            "single-process kernel",
            flush=True,
        )
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
