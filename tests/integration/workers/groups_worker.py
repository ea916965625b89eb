"""Worker for the distributed-layer integration tests (`test_groups_multiproc.py`).

Run under `paddle.distributed.launch`. Scenarios:

* `check --topology DPxPPxCP ...`: build the groups of each topology and check every flashcp
  collective on every group exactly (values and byte counters); prints `CHECKED <label>` per
  group and `WORKER DONE` at the end.
* `timeout --skip-rank R --timeout S`: every rank but R calls all_gather on the world group;
  rank R skips it and sleeps, so the others must be ended by the watchdog.

Any failed check raises, so the worker exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import paddle

from flashcp.distributed import (
    ParallelDims,
    ParallelGroups,
    all_gather_tensor,
    all_reduce_tensor,
    barrier,
    broadcast_tensor,
    build_groups,
    check,
    comm_stats,
    destroy_groups,
    group_backend,
    init_distributed,
    nbytes,
    reduce_scatter,
    reduce_scatter_chunks,
    reset_comm_stats,
    ring_shift,
    shutdown,
    world_group,
)
from flashcp.distributed.collectives import odd_gloo_cycle
from flashcp.distributed.groups import NamedGroup
from flashcp.distributed.p2p import recv_tensor, send_tensor


def _topology(text: str) -> tuple[int, int, int]:
    dp, pp, cp = (int(v) for v in text.lower().split("x"))
    return dp, pp, cp


def _eq(name: str, got: paddle.Tensor, want: np.ndarray) -> None:
    if not np.array_equal(got.cpu().numpy(), want):
        raise AssertionError(f"{name}: got {got.numpy().tolist()} want {want.tolist()}")


def _expect_bytes(name: str, op: str, group: NamedGroup, sent: float, received: float) -> None:
    stats = comm_stats(op, group.label)
    if (stats.sent, stats.received) != (int(sent), int(received)):
        raise AssertionError(
            f"{name} bytes on {group.label}: sent/received {stats.sent}/{stats.received}, "
            f"expected {int(sent)}/{int(received)}"
        )


def _value(rank: int) -> np.ndarray:
    return (np.arange(6, dtype=np.float32).reshape(2, 3) + 100 * rank).astype(np.float32)


def _raises(name: str, kind: type[Exception], text: str, call: Callable[[], object]) -> None:
    try:
        call()
    except kind as exc:
        if text not in str(exc):
            raise AssertionError(f"{name}: message {exc} lacks {text!r}") from exc
    else:
        raise AssertionError(f"{name}: expected {kind.__name__}")


def check_group(group: NamedGroup, rank: int) -> dict[str, int]:
    """Exact checks of every collective on `group`; returns this rank's byte totals."""
    ranks, p, me = group.ranks, group.nranks, group.rank
    reset_comm_stats()

    x = paddle.to_tensor(_value(rank))
    _eq(
        "all_gather axis 0",
        all_gather_tensor(x, group, 0),
        np.concatenate([_value(r) for r in ranks], axis=0),
    )
    _eq(
        "all_gather axis 1",
        all_gather_tensor(x, group, axis=1),
        np.concatenate([_value(r) for r in ranks], axis=1),
    )
    _expect_bytes(
        "all_gather", "all_gather", group, 2 * (p - 1) * nbytes(x), 2 * (p - 1) * nbytes(x)
    )

    _eq("all_reduce", all_reduce_tensor(x, group), sum(_value(r) for r in ranks))
    _eq("all_reduce leaves input", x, _value(rank))

    # chunks[i] is destined to group rank i; my result is the sum over ranks of chunk `me`.
    chunks = [paddle.full([4], 10.0 * rank + i, dtype="float32") for i in range(p)]
    want = np.full([4], sum(10.0 * r + me for r in ranks), dtype=np.float32)
    total = sum(nbytes(c) for c in chunks)
    reset_comm_stats()
    odd = odd_gloo_cycle(group)  # gloo cannot pair an odd ring: "ring" refused, auto = allreduce
    if odd:
        _raises("reduce_scatter ring (odd gloo ring)", ValueError, "an odd ring",
                lambda: reduce_scatter_chunks(chunks, group, method="ring"))  # fmt: skip
    else:
        _eq("reduce_scatter ring", reduce_scatter_chunks(chunks, group, method="ring"), want)
        _expect_bytes("ring", "reduce_scatter", group, (p - 1) * total / p, (p - 1) * total / p)
    reset_comm_stats()
    _eq("reduce_scatter allreduce", reduce_scatter_chunks(chunks, group, method="allreduce"), want)
    _expect_bytes(
        "allreduce", "reduce_scatter", group, 2 * (p - 1) * total / p, 2 * (p - 1) * total / p
    )
    _eq("reduce_scatter auto", reduce_scatter_chunks(chunks, group), want)
    # 1 MiB chunks: large enough that gloo sends really block on the matching receive.
    big = [paddle.full([1 << 18], float(rank + 7 * i), dtype="float32") for i in range(p)]
    big_want = np.full([1 << 18], sum(float(r + 7 * me) for r in ranks), dtype=np.float32)
    method = "allreduce" if odd else "ring"
    _eq("reduce_scatter 1MiB", reduce_scatter_chunks(big, group, method=method), big_want)
    _eq("ring_shift 1MiB", ring_shift(big[0], group), np.full([1 << 18], float(ranks[me - 1])))
    stacked = paddle.concat(chunks)  # p * 4 elements, split back into p chunks
    _eq("reduce_scatter stacked", reduce_scatter(stacked, group), want)
    if group_backend(group) == "nccl":
        _eq("reduce_scatter nccl", reduce_scatter_chunks(chunks, group, method="nccl"), want)
    else:
        try:
            reduce_scatter_chunks(chunks, group, method="nccl")
        except ValueError:
            pass
        else:
            raise AssertionError("method='nccl' on a gloo group should raise ValueError")

    src = ranks[-1]
    _eq("broadcast", broadcast_tensor(x.clone(), src, group), _value(src))

    for shift in sorted({1, -1, 2 % p}):
        _eq(f"ring_shift {shift}", ring_shift(x, group, shift), _value(ranks[(me - shift) % p]))

    barrier(group)
    return {"sent": comm_stats(group=group.label).sent}


def build_and_check(dims: ParallelDims, rank: int) -> ParallelGroups:
    groups = build_groups(dims)
    for dim in ("world", "dp", "pp", "cp"):
        group = groups[dim]
        want = dims.group_ranks(dim, rank)
        if group.ranks != want or group.rank != want.index(rank):
            raise AssertionError(f"{dim}: got {group!r}, want ranks {want}")
        if group.is_trivial:
            continue
        check_group(group, rank)
        print(f"CHECKED {dims.describe()} {group.label}", flush=True)
    return groups


def scenario_timeout(skip_rank: int, seconds: float, rank: int) -> None:
    world = world_group()
    if rank == skip_rank:
        print(f"rank {rank} skips the all_gather and hangs", flush=True)
        time.sleep(120)
        return
    all_gather_tensor(paddle.ones([2]), world, timeout=seconds)
    raise AssertionError("all_gather returned although a rank skipped it")


def check_mode(groups: ParallelGroups, rank: int) -> None:
    """`FLASHCP_CHECK_COLLECTIVES=1` on a two-rank cp group: matching calls pass (a
    collective, an ordered send/recv), diverging ones raise `CollectiveMismatchError` on BOTH
    ranks, naming each rank's call — a different collective, and two sends at once (which on
    gloo would deadlock). Prints `MISMATCH <message>` for each."""
    cp = groups.cp
    peer = cp.ranks[1 - cp.rank]
    os.environ[check.ENV_CHECK] = "1"
    try:
        all_reduce_tensor(paddle.ones([3]), cp)
        if cp.rank == 0:
            send_tensor(paddle.ones([2, 4]), peer, cp)
        else:
            recv_tensor([2, 4], paddle.float32, peer, cp)
        diverging: list[Callable[[], object]] = [
            lambda: all_reduce_tensor(paddle.ones([3]), cp)
            if cp.rank == 0
            else all_gather_tensor(paddle.ones([1, 4]), cp),
            lambda: send_tensor(paddle.ones([2]), peer, cp),
        ]
        for call in diverging:
            try:
                call()
            except check.CollectiveMismatchError as exc:
                print(f"MISMATCH {exc}", flush=True)
            else:
                raise AssertionError("check mode let two ranks diverge")
    finally:
        del os.environ[check.ENV_CHECK]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["check", "timeout"])
    parser.add_argument("--topology", action="append", default=[], type=_topology)
    parser.add_argument("--skip-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--check-mode", action="store_true", help="also check_mode (cp 2)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    env = init_distributed()
    print(f"INIT rank {env.rank}/{env.world_size} in {time.monotonic() - started:.2f}s", flush=True)
    if args.scenario == "timeout":
        scenario_timeout(args.skip_rank, args.timeout, env.rank)
        return 0
    summary = []
    for dp, pp, cp in args.topology:
        dims = ParallelDims(dp=dp, pp=pp, cp=cp, world_size=env.world_size)
        groups = build_and_check(dims, env.rank)
        if args.check_mode:
            check_mode(groups, env.rank)
        summary.append(groups.describe())
        destroy_groups(groups)
    shutdown()
    print("RESULT " + json.dumps({"rank": env.rank, "groups": summary}), flush=True)
    print(f"WORKER DONE in {time.monotonic() - started:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
