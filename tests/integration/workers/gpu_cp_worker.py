"""Worker: CP FlashMask attention with the REAL GPU kernels over NCCL vs the CPU reference.

Run under `paddle.distributed.launch` with N processes on N GPUs. Every rank builds the same
global bf16-rounded q/k/v/dout, runs `flashmask_attention_cp` forward and backward on its
shard on its GPU (the FlashAttention version is whatever this card and the flags resolve to),
and compares its output, dq, dk and dv with the float32 CPU reference kernel's whole-sequence
result at its global positions (`helpers.gpu.TOLERANCE`). A wrong shard must fail the same
comparison, and - with FLAGS_cudnn_deterministic set - two runs must be bitwise identical.
Results go to `<out>/rank<r>.json`; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import paddle

from flashcp import fa_dispatch, mask_families
from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.registry import MODES, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import ParallelDims, build_groups, init_distributed, shutdown
from helpers.gpu import close, cpu_reference, rounded

DTYPE = "bfloat16"  # --dtype float32 dry-runs the worker on CPU over gloo
B, HQ, HKV, D = 1, 4, 2, 64
FAMILIES = ("causal", "causal_document", "document", "share_question", "global_sliding_window")


def run_cp(q, k, v, dout, idx, causal, mode, group, rank, world, dtype):
    """This rank's shards on its GPU → CP forward/backward → float32 numpy, and positions."""
    asg = make_assignment(mode, world, idx, causal=causal)
    pos = asg.positions(q.shape[1], rank)

    def local(x):
        return paddle.to_tensor(shard_assigned(x, rank, asg, axis=1)).astype(dtype)

    tq, tk, tv = (local(x) for x in (q, k, v))
    for t in (tq, tk, tv):
        t.stop_gradient = False
    out = flashmask_attention_cp(tq, tk, tv, idx, group=group, causal=causal, mode=mode,
                                 fa4_unavailable="fallback")  # fmt: skip
    out.backward(local(dout))
    got = tuple(t.astype("float32").numpy() for t in (out, tq.grad, tk.grad, tv.grad))
    return got, pos


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-per-rank", type=int, default=128)
    parser.add_argument("--dtype", default=DTYPE, choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args()
    dtype = args.dtype

    env = init_distributed()
    world = env.world_size
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=world, world_size=world))
    group, rank = groups.cp, groups.cp.rank
    seq = args.seq_per_rank * world
    rng = np.random.default_rng(2024)  # same stream on every rank: same global inputs
    q, k, v, dout = (
        rounded(rng.standard_normal(s).astype(np.float32), dtype)
        for s in ((B, seq, HQ, D), (B, seq, HKV, D), (B, seq, HKV, D), (B, seq, HQ, D))
    )
    version = fa_dispatch.resolve_current(D, policy="fallback").version
    cases = []
    for family in FAMILIES:
        mask = mask_families.FAMILIES[family](B, seq, 1, 5)
        ref = cpu_reference(q, k, v, dout, mask.indices, causal=mask.causal)
        whole = (ref[0], ref[2], ref[3], ref[4])  # out, dq, dk, dv
        for mode in MODES:
            got, pos = run_cp(
                q, k, v, dout, mask.indices, mask.causal, mode, group, rank, world, dtype
            )
            names = ("out", "dq", "dk", "dv")
            ok = {n: close(a, w[:, pos], dtype) for n, a, w in zip(names, got, whole, strict=True)}
            errors = {
                n: float(np.abs(a - w[:, pos]).max())
                for n, a, w in zip(names, got, whole, strict=True)
            }
            other = make_assignment(mode, world, mask.indices, causal=mask.causal).positions(
                seq, (rank + 1) % world
            )
            wrong_rejected = not close(got[0], whole[0][:, other], dtype)
            cases.append({"family": family, "mode": mode, "ok": ok, "errors": errors,
                          "wrong_shard_rejected": wrong_rejected})  # fmt: skip
            print(f"CASE {family} {mode} ok={all(ok.values())} errors={errors}", flush=True)

    mask = mask_families.FAMILIES["causal_document"](B, seq, 1, 5)
    again = (q, k, v, dout, mask.indices, True, "dualchunk_allgather", group, rank, world, dtype)
    first, _ = run_cp(*again)
    second, _ = run_cp(*again)
    bitwise = all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))

    report = {"rank": rank, "world": world, "version": version, "device": paddle.get_device(),
              "dtype": dtype, "cases": cases, "bitwise": bitwise}  # fmt: skip
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    bad = [c for c in cases if not all(c["ok"].values()) or not c["wrong_shard_rejected"]]
    shutdown()
    if bad or not bitwise:
        raise SystemExit(f"rank {rank}: {len(bad)} failing cases, bitwise={bitwise}: {bad[:3]}")
    print(f"GPU CP PARITY DONE rank={rank} cases={len(cases)} fa_version={version}", flush=True)


if __name__ == "__main__":
    main()
