"""Worker: CP FlashMask attention vs the single-process dense reference, per rank.

Run under `paddle.distributed.launch` with N processes. For every mask family (and per-head
variants), every CP mode, it shards global q/k/v/dout, runs `flashmask_attention_cp` forward and
backward, and compares this rank's output, LSE, dq, dk and dv with the dense float64
reference's rows at this rank's global positions under the float32 rule of `bench.numerics`
(`reference.compare_attention`, n = the global `seq`: the allowance is the single-process
one). It also
checks that the comparison fails against another rank's rows by a wide margin (the tolerance
is meaningful), and that two runs of the same case are bitwise identical (same layout, same
order). Results go to `<out>/rank<r>.json`; any failure raises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import paddle

from bench.numerics import FACTOR
from flashcp import mask_families
from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.registry import MODES, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import ParallelDims, build_groups, init_distributed, shutdown
from helpers.reference import compare_attention, dense_reference

WRONG_MARGIN = 10.0
"""A wrong shard must miss the allowance by at least this factor."""
B, HQ, HKV, D = 2, 4, 2, 16
PER_HEAD = {"sliding_window_per_head": (HKV, HQ), "random_eviction": (HKV, HQ)}


def run_cp(q, k, v, dout, idx, causal, mode, group, rank, world, frozen=""):
    """Local shards → CP forward/backward → numpy (out, lse, dq, dk, dv, positions).

    `frozen` names inputs created with stop_gradient (e.g. "k": LoRA on q_proj and v_proj
    only); their gradient is returned as None and must not exist."""
    asg = make_assignment(mode, world, idx, causal=causal)
    pos = asg.positions(q.shape[1], rank)
    tq, tk, tv = (
        paddle.to_tensor(shard_assigned(x, rank, asg, axis=1), stop_gradient=name in frozen)
        for name, x in zip("qkv", (q, k, v), strict=True)
    )
    out, lse = flashmask_attention_cp(
        tq, tk, tv, idx, group=group, causal=causal, mode=mode, return_lse=True
    )
    out.backward(paddle.to_tensor(shard_assigned(dout, rank, asg, axis=1)))
    grads = tuple(None if t.grad is None else t.grad.numpy() for t in (tq, tk, tv))
    return (out.numpy(), lse.numpy(), *grads), pos


def local_rows(ref, pos):
    out, lse, dq, dk, dv = ref
    return (out[:, pos], lse[:, :, pos], dq[:, pos], dk[:, pos], dv[:, pos])


def units(got, want, seq: int, label: str = "") -> dict[str, float]:
    """Each array's error in units of the rule (`numerics`: ok when <= FACTOR); the
    reductions run over the global `seq` keys / queries (or the head dim D)."""
    cmp = compare_attention(got, want, n=max(seq, D), label=label)
    return {c.what[len(label) :]: c.units for c in cmp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-per-rank", type=int, default=24)
    args = parser.parse_args()

    env = init_distributed()
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=env.world_size, world_size=env.world_size))
    group, world = groups.cp, env.world_size
    rank = group.rank
    seq = args.seq_per_rank * world
    rng = np.random.default_rng(1234)  # same stream on every rank: same global inputs
    q = rng.standard_normal((B, seq, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, seq, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, seq, HKV, D)).astype(np.float32)
    dout = rng.standard_normal((B, seq, HQ, D)).astype(np.float32)

    results = []
    for family, make in sorted(mask_families.FAMILIES.items()):
        for heads in (1, *PER_HEAD.get(family, ())):
            mask = make(B, seq, heads, 7)
            ref = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
            for mode in MODES:
                got, pos = run_cp(
                    q, k, v, dout, mask.indices, mask.causal, mode, group, rank, world
                )
                want = local_rows(ref, pos)
                case = {"family": family, "heads": heads, "mode": mode, "causal": mask.causal}
                case["units"] = units(got, want, seq)
                case["ok"] = max(case["units"].values()) <= FACTOR
                if world > 1:
                    other = (rank + 1) % world
                    other_pos = make_assignment(mode, world, mask.indices, causal=mask.causal)
                    wrong = local_rows(ref, other_pos.positions(seq, other))
                    case["wrong_units"] = max(units(got, wrong, seq, "wrong shard ").values())
                    case["wrong_shard_rejected"] = case["wrong_units"] > WRONG_MARGIN * FACTOR
                results.append(case)
                print(f"CASE {family} heads={heads} mode={mode} ok={case['ok']}", flush=True)

    # Determinism: the same case twice gives bitwise-identical outputs and gradients.
    mask = mask_families.FAMILIES["causal_document"](B, seq, 1, 7)
    first, _ = run_cp(q, k, v, dout, mask.indices, True, "dualchunk_allgather", group, rank, world)
    second, _ = run_cp(q, k, v, dout, mask.indices, True, "dualchunk_allgather", group, rank, world)
    bitwise = all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    # k frozen (LoRA on q_proj and v_proj only): no dk, the rest as with every gradient.
    part, _ = run_cp(
        q, k, v, dout, mask.indices, True, "dualchunk_allgather", group, rank, world, frozen="k"
    )
    frozen_k = part[3] is None and all(
        np.array_equal(a, b) for i, (a, b) in enumerate(zip(first, part, strict=True)) if i != 3
    )

    report = {"rank": rank, "world": world, "seq": seq, "cases": results, "bitwise": bitwise}
    report["frozen_k"] = frozen_k
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    bad = [c for c in results if not c["ok"] or not c.get("wrong_shard_rejected", True)]
    if bad or not bitwise or not frozen_k:
        raise SystemExit(
            f"rank {rank}: {len(bad)} failing cases, bitwise={bitwise}, frozen_k={frozen_k}: "
            f"{bad[:3]}"
        )
    print(f"CP PARITY DONE rank={rank} cases={len(results)}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
