"""Worker: expert parallelism's pieces on N gloo processes (N odd exercises the pair links).

Run under `paddle.distributed.launch` (layout dp=1, pp=1, cp=N, ep=N). Checks, each exactly or
under the float32 rule of `bench.numerics`, and writes `<out>/rank<r>.json`:

* `all_to_all`: rank r sends `(r + 2j) mod 3` rows to rank j (empty blocks included), every
  value encoding (source, destination, row): the received blocks are exactly the expected
  ones, twice in a row (the gloo tags stay in step), and the byte counters hold exactly the
  nbytes of the blocks that crossed ranks;
* `gather_rows`: the root gets every rank's rows in rank order, the others None; bytes;
* one MoE layer (6 experts, top-2, a shared expert) split over the ranks against the whole
  layer on the same weights: output, input gradient and expert gradients (summed over the
  ranks) within the rule (n = the rows behind each sum); a NEGATIVE CONTROL — the ep layer
  built with the next rank's experts (a wrong expert offset) — must fail the same comparison
  by a wide margin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import paddle

from bench.numerics import compare
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    all_to_all,
    build_groups,
    comm_stats,
    gather_rows,
    init_distributed,
    reset_comm_stats,
    shutdown,
)
from flashcp.models import preset
from flashcp.models.expert_parallel import attach_exchange, expert_range
from flashcp.models.moe import MoE

EXPERTS, TOP_K, H, INTER, TOKENS = 6, 2, 16, 8, 40


def block(src: int, dst: int, rows: int) -> np.ndarray:
    """The rows `src` sends `dst`: value = 100·src + 10·dst + row, 2 columns."""
    base = 100 * src + 10 * dst + np.arange(rows, dtype=np.float32)
    return np.stack([base, -base], axis=1).astype(np.float32)


def check_all_to_all(exchange, p: int, r: int) -> dict:
    sizes = [[(s + 2 * d) % 3 for d in range(p)] for s in range(p)]
    send = np.concatenate([block(r, d, sizes[r][d]) for d in range(p)])
    want = np.concatenate([block(s, r, sizes[s][r]) for s in range(p)])
    reset_comm_stats()
    for _ in range(2):
        got = all_to_all(
            paddle.to_tensor(send), sizes[r], [sizes[s][r] for s in range(p)], exchange
        )
        if not np.array_equal(got.numpy(), want):
            raise AssertionError(f"all_to_all on rank {r}: got {got.numpy()} want {want}")
    stats = comm_stats("all_to_all", exchange.label)
    sent = 2 * 8 * sum(sizes[r][d] for d in range(p) if d != r)
    received = 2 * 8 * sum(sizes[s][r] for s in range(p) if s != r)
    if (stats.calls, stats.sent, stats.received) != (2, sent, received):
        raise AssertionError(f"all_to_all bytes on rank {r}: {stats} vs {sent}, {received}")
    return {"sent": stats.sent, "received": stats.received}


def check_gather(exchange, p: int, r: int) -> None:
    reset_comm_stats()
    out = gather_rows(paddle.full([2, 3], float(r)), exchange)
    stats = comm_stats("gather", exchange.label)
    if r == 0:
        want = np.repeat(np.arange(p, dtype=np.float32), 2)[:, None] * np.ones((1, 3), np.float32)
        if out is None or not np.array_equal(out.numpy(), want):
            raise AssertionError(f"gather_rows on the root: {out}")
        if (stats.sent, stats.received) != (0, (p - 1) * 24):
            raise AssertionError(f"gather bytes on the root: {stats}")
    elif out is not None or (stats.sent, stats.received) != (24, 0):
        raise AssertionError(f"gather_rows on rank {r}: {out}, {stats}")


def run(module: MoE, x: np.ndarray, probe: np.ndarray) -> dict[str, np.ndarray]:
    xt = paddle.to_tensor(x)
    xt.stop_gradient = False
    out = module(xt)
    (out * paddle.to_tensor(probe)).sum().backward()
    res = {"out": out.numpy(), "x.grad": xt.grad.numpy()}
    for name in ("gate_up_proj", "down_proj"):
        res[name] = getattr(module.experts, name).grad.numpy()
    return res


def ep_layer(whole: MoE, args, held: range, exchange, source: range) -> MoE:
    """The ep layer holding experts `held`, its weights copied from the whole layer's experts
    `source` (= `held` unless it is the negative control)."""
    layer = MoE(args, experts=held)
    weights = dict(whole.named_parameters())
    with paddle.no_grad():
        for name, param in layer.named_parameters():
            value = weights[name]
            if name.startswith("experts."):
                value = value[source.start : source.stop]
            param.set_value(value)
    attach_exchange(layer, exchange)
    return layer


def check_layer(groups, exchange, p: int, r: int) -> dict:
    args = preset(
        "tiny_glm_moe", hidden_size=H, num_heads=2, num_kv_heads=1, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, num_shared_experts=1,
    )  # fmt: skip
    paddle.seed(0)
    whole = MoE(args)
    held = expert_range(EXPERTS, p, r)
    wrong = expert_range(EXPERTS, p, (r + 1) % p)
    rng = np.random.default_rng(10 + r)
    x = rng.standard_normal((2, TOKENS // 2, H)).astype(np.float32)
    probe = rng.standard_normal(x.shape).astype(np.float32)
    want = run(whole, x, probe)
    for name in ("gate_up_proj", "down_proj"):  # every rank's tokens reach every expert
        want[name] = all_reduce_tensor(paddle.to_tensor(want[name]), groups.ep).numpy()
        want[name] = want[name][held.start : held.stop]
    out: dict = {"units": {}, "wrong_units": {}}
    for label, source in (("ok", held), ("wrong", wrong)):
        got = run(ep_layer(whole, args, held, exchange, source), x, probe)
        for key in want:
            n = TOKENS * TOP_K * p if key in ("gate_up_proj", "down_proj") else H  # reductions
            c = compare(got[key], want[key], n=n, norm="l2", what=f"{label} {key}")
            (out["units"] if label == "ok" else out["wrong_units"])[key] = c.units
            if label == "ok" and not c.ok:
                raise AssertionError(c.describe())
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    paddle.set_device("cpu")
    env = init_distributed()
    n, r = env.world_size, env.rank
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=n, world_size=n, ep=n))
    exchange = groups.ep_exchange()
    report = {
        "world": n,
        "links": sorted(exchange.links),
        "all_to_all": check_all_to_all(exchange, n, r),
    }
    check_gather(exchange, n, r)
    report["layer"] = check_layer(groups, exchange, n, r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{r}.json").write_text(json.dumps(report, indent=2))
    print("WORKER DONE", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
