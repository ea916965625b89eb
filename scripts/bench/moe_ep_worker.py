"""One rank of `scripts/bench_moe.py`'s expert-parallel part (run under paddle.distributed.launch).

Every rank builds the GLM-4.5-shaped MoE layer of the case twice from one seed: the whole layer
(all experts: the ep = 1 reference) and its ep rank's stage-only layer (its E/ep experts, the
router and shared expert copied from the whole one), attached to the job's ep group. On its own
tokens (a rank-specific seed) it runs one forward + backward of ``sum(layer(x) · probe)`` on
each and records:

* the bytes `flashcp.distributed.all_to_all` counted at the transfer during the ep layer's pass
  (op ``all_to_all``: dispatch and combine forward, their reverses backward), and the counts'
  all-gather;
* the expectation from the call's own counts (`DispatchPlan`: rows routed to other ranks'
  experts, sent by dispatch forward and combine backward; rows received for this rank's
  experts, sent back by combine forward and dispatch backward) and the uniform-routing theory
  ``4 · T·k·(ep-1)/ep · H · 4`` bytes;
* the largest norm-wise relative difference of the ep layer's output, input gradient and
  expert gradients (summed over the ranks) from the whole layer's.

Writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", required=True, help="TxHxI")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    tokens, hidden, inter = (int(x) for x in args.case.lower().split("x"))

    import paddle

    from flashcp.distributed import (
        ParallelDims,
        all_reduce_tensor,
        build_groups,
        comm_stats,
        init_distributed,
        reset_comm_stats,
        shutdown,
    )
    from flashcp.models import preset
    from flashcp.models.expert_parallel import (
        DispatchPlan,
        attach_exchange,
        exchange_counts,
        expert_range,
        uniform_bytes_per_rank,
    )
    from flashcp.models.moe import MoE
    from flashcp.models.moe_dispatch import build_dispatch

    paddle.set_device("cpu")
    env = init_distributed()
    ep = env.world_size
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=ep, world_size=ep, ep=ep))
    rank = int(groups.ep.rank)
    margs = preset(
        "tiny_glm_moe",
        hidden_size=hidden,
        num_heads=2,
        num_kv_heads=1,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=inter,
        num_shared_experts=1,
        norm_topk_prob=True,
    )
    paddle.seed(args.seed)
    whole = MoE(margs)
    held = expert_range(args.experts, ep, rank)
    layer = MoE(margs, experts=held)
    with paddle.no_grad():
        for name, param in layer.named_parameters():
            value = dict(whole.named_parameters())[name]
            if name.startswith("experts."):
                value = value[held.start : held.stop]
            param.set_value(value)
    exchange = groups.ep_exchange()
    attach_exchange(layer, exchange)

    rng = np.random.default_rng(args.seed + 1 + rank)
    x = rng.standard_normal((1, tokens, hidden)).astype(np.float32)
    probe = paddle.to_tensor(rng.standard_normal(x.shape).astype(np.float32))

    def run(module: MoE) -> dict[str, np.ndarray]:
        xt = paddle.to_tensor(x)
        xt.stop_gradient = False
        out = module(xt)
        (out * probe).sum().backward()
        res = {"out": out.numpy(), "x.grad": xt.grad.numpy()}
        for name in ("gate_up_proj", "down_proj"):
            res[name] = getattr(module.experts, name).grad.numpy()
        return res

    with paddle.no_grad():  # the call's counts, as the layer will exchange them
        ids, _ = whole.gate(paddle.to_tensor(x.reshape(tokens, hidden)))
        counts = build_dispatch(ids, args.experts).counts
    plan = DispatchPlan(exchange_counts(counts, exchange), rank)
    reset_comm_stats()
    got = run(layer)
    moved = comm_stats("all_to_all")
    gathered = comm_stats("all_gather")
    want = run(whole)
    for name in ("gate_up_proj", "down_proj"):  # expert gradients: every rank's tokens
        summed = all_reduce_tensor(paddle.to_tensor(want[name]), groups.ep)
        want[name] = summed.numpy()[held.start : held.stop]

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    row = hidden * 4  # float32 activations
    expected_sent = 2 * (plan.bytes_sent(row) + plan.bytes_received(row))
    expected_received = 2 * (plan.bytes_received(row) + plan.bytes_sent(row))
    record = {
        "rank": rank,
        "ep": ep,
        "case": args.case,
        "tokens": tokens,
        "hidden": hidden,
        "inter": inter,
        "experts": args.experts,
        "top_k": args.top_k,
        "experts_held": [held.start, held.stop],
        "rows_sent_dispatch": plan.bytes_sent(1),
        "rows_received_dispatch": plan.bytes_received(1),
        "all_to_all_calls": moved.calls,
        "sent_bytes": moved.sent,
        "received_bytes": moved.received,
        "expected_sent_bytes": expected_sent,
        "expected_received_bytes": expected_received,
        "uniform_bytes": 4 * uniform_bytes_per_rank(tokens, args.top_k, hidden, 4, ep),
        "counts_all_gather_bytes": gathered.sent,
        "max_rel_diff": max(rel(got[k], want[k]) for k in want),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"rank {rank}: {json.dumps(record)}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
