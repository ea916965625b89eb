"""Worker: chunked all-gather-KV attention vs the unchunked implementation, per rank.

Run under `paddle.distributed.launch` with N processes (one CP group of N). For several mask
families, every CP mode and chunk shapes that do and do not divide the local length, it runs
this rank's shards through the chunked implementation (`attention.query_chunk` /
`attention.kv_chunk`) and through the unchunked all-gather-KV implementation on the same
layout, and compares output, LSE, dq, dk and dv under `bench.numerics`'s rule (n = the
global sequence), and against the dense float64 oracle's rows at this rank's positions. A
negative control merges the key chunks without their LSE rescale and must fail by a wide
margin; the same case run twice is bitwise identical. Finally the allocator peak of one
attention forward + backward at two longer sequences, chunked and unchunked (the gathered K/V
and the float32 dK/dV partial sums are Paddle tensors).
Results go to `<out>/rank<r>.json`; any failure raises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import paddle

from bench.numerics import FACTOR
from flashcp import mask_families, masks
from flashcp.attention import allgather_kv_chunked as chunked
from flashcp.attention.allgather_kv import ALLGATHER_KV
from flashcp.attention.allgather_kv_chunked import ALLGATHER_KV_CHUNKED
from flashcp.attention.context import AttentionContext
from flashcp.attention.registry import MODES, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import ParallelDims, build_groups, init_distributed, shutdown
from flashcp.metrics.memory import PeakMeter
from helpers.reference import compare_attention, dense_reference

WRONG_MARGIN = 10.0
MEMORY_QUERY_CHUNK = 128
"""Query rows per call in the memory measurement."""
MEMORY_KV_CHUNK = 128
"""Local rows per rank in one gathered key chunk in the memory measurement."""
B, HQ, HKV, D = 2, 4, 2, 16
FAMILIES = {"causal": 1, "causal_document": 1, "share_question": 1, "sliding_window": 1,
            "random_eviction": HKV}  # fmt: skip


def chunk_shapes(local: int, world: int) -> list[tuple[int, int]]:
    """(query_chunk, kv_chunk): dividing, not dividing, keys only, queries only."""
    return [(8, 4 * world), (5, 3 * world), (0, world * local // 2), (local // 3, 0)]


def run(impl, q, k, v, dout, idx, causal, mode, group, rank, world, **chunks):
    """This rank's shards through `impl` on `mode`'s layout → numpy (out, lse, dq, dk, dv)."""
    asg = make_assignment(mode, world, idx, causal=causal)
    tq, tk, tv = (
        paddle.to_tensor(shard_assigned(x, rank, asg, axis=1), stop_gradient=False)
        for x in (q, k, v)
    )
    ctx = AttentionContext(
        mask=idx, causal=causal, group=group, assignment=asg, mode=mode, **chunks
    )
    out, lse = impl.apply_with_lse(tq, tk, tv, ctx.plan(impl, tq, tk, tv))
    out.backward(paddle.to_tensor(shard_assigned(dout, rank, asg, axis=1)))
    got = (out.numpy(), lse.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())
    return got, asg.positions(q.shape[1], rank)


def units(got, want, seq: int) -> dict[str, float]:
    return {c.what: c.units for c in compare_attention(got, want, n=max(seq, D))}


def local_rows(ref, pos):
    out, lse, dq, dk, dv = ref
    return (out[:, pos], lse[:, :, pos], dq[:, pos], dk[:, pos], dv[:, pos])


def naive_merge(acc, out, lse):
    """The bug the LSE merge prevents: key chunks' outputs averaged, not softmax-weighted."""
    out = out.astype("float32")
    if acc is None:
        return out, lse
    return (acc[0] + out) / 2, paddle.maximum(acc[1], lse)


def peak(impl, q, k, v, dout, idx, group, rank, world, **chunks) -> int:
    with PeakMeter() as meter:
        run(impl, q, k, v, dout, idx, True, "dualchunk_allgather", group, rank, world, **chunks)
    return meter.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-per-rank", type=int, default=24)
    parser.add_argument("--memory-seq-per-rank", type=int, nargs="+", default=[512, 1024])
    args = parser.parse_args()

    env = init_distributed()
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=env.world_size, world_size=env.world_size))
    group, world = groups.cp, env.world_size
    rank = group.rank
    local = args.seq_per_rank
    seq = local * world
    rng = np.random.default_rng(4321)  # the same global inputs on every rank
    q = rng.standard_normal((B, seq, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, seq, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, seq, HKV, D)).astype(np.float32)
    dout = rng.standard_normal((B, seq, HQ, D)).astype(np.float32)

    results = []
    for family, heads in FAMILIES.items():
        mask = mask_families.FAMILIES[family](B, seq, heads, 7)
        dense = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
        for mode in MODES:
            plain, pos = run(ALLGATHER_KV, q, k, v, dout, mask.indices, mask.causal, mode,
                             group, rank, world)  # fmt: skip
            for qc, kc in chunk_shapes(local, world):
                got, _ = run(ALLGATHER_KV_CHUNKED, q, k, v, dout, mask.indices, mask.causal,
                             mode, group, rank, world, query_chunk=qc, kv_chunk=kc)  # fmt: skip
                case = {"family": family, "mode": mode, "query_chunk": qc, "kv_chunk": kc}
                case["units"] = units(got, plain, seq)
                case["dense_units"] = units(got, local_rows(dense, pos), seq)
                worst = max(*case["units"].values(), *case["dense_units"].values())
                case["ok"] = worst <= FACTOR
                results.append(case)
                print(f"CASE {family} {mode} q={qc} kv={kc} ok={case['ok']}", flush=True)

    # negative control: merging the key chunks without the LSE rescale
    mask = mask_families.FAMILIES["causal_document"](B, seq, 1, 7)
    want, _ = run(ALLGATHER_KV, q, k, v, dout, mask.indices, True, "dualchunk_allgather",
                  group, rank, world)  # fmt: skip
    real = chunked.merge_partial
    chunked.merge_partial = naive_merge
    try:
        wrong, _ = run(ALLGATHER_KV_CHUNKED, q, k, v, dout, mask.indices, True,
                       "dualchunk_allgather", group, rank, world, query_chunk=8,
                       kv_chunk=4 * world)  # fmt: skip
    finally:
        chunked.merge_partial = real
    wrong_units = max(units(wrong, want, seq).values())

    # determinism: the same chunked case twice is bitwise identical
    kwargs = {"query_chunk": 5, "kv_chunk": 3 * world}
    first, _ = run(ALLGATHER_KV_CHUNKED, q, k, v, dout, mask.indices, True,
                   "dualchunk_allgather", group, rank, world, **kwargs)  # fmt: skip
    second, _ = run(ALLGATHER_KV_CHUNKED, q, k, v, dout, mask.indices, True,
                    "dualchunk_allgather", group, rank, world, **kwargs)  # fmt: skip
    bitwise = all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))

    # memory: one causal attention forward + backward at two longer sequences; chunks of a
    # fixed size, so the chunked peak grows only with the local rows
    memory = []
    for mlocal in args.memory_seq_per_rank:
        mseq = mlocal * world
        mq = rng.standard_normal((B, mseq, HQ, D)).astype(np.float32)
        mk = rng.standard_normal((B, mseq, HKV, D)).astype(np.float32)
        mv = rng.standard_normal((B, mseq, HKV, D)).astype(np.float32)
        md = rng.standard_normal((B, mseq, HQ, D)).astype(np.float32)
        midx = masks.causal_mask(B, mseq).indices
        chunks = {"query_chunk": MEMORY_QUERY_CHUNK, "kv_chunk": MEMORY_KV_CHUNK * world}
        memory.append({
            "local": mlocal,
            "seq": mseq,
            "unchunked": peak(ALLGATHER_KV, mq, mk, mv, md, midx, group, rank, world),
            "chunked": peak(ALLGATHER_KV_CHUNKED, mq, mk, mv, md, midx, group, rank, world,
                            **chunks),
            **chunks,
        })  # fmt: skip

    report = {
        "rank": rank,
        "world": world,
        "seq": seq,
        "cases": results,
        "wrong_units": wrong_units,
        "naive_merge_rejected": wrong_units > WRONG_MARGIN * FACTOR,
        "bitwise": bitwise,
        "memory": memory,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    bad = [c for c in results if not c["ok"]]
    if bad or not bitwise or not report["naive_merge_rejected"]:
        raise SystemExit(
            f"rank {rank}: {len(bad)} failing cases, bitwise={bitwise}, naive merge "
            f"{wrong_units:.3g} units: {bad[:3]}"
        )
    print(f"CHUNKED PARITY DONE rank={rank} cases={len(results)} memory={memory}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
