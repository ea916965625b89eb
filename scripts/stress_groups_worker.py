"""One launched process of `scripts/stress_groups.py` (run under `paddle.distributed.launch`).

For each `--topology DPxPPxCP` it builds the groups of that layout, checks each group's ranks,
runs an all_reduce and a ring reduce-scatter on every non-trivial group (exact results), prints
`CHECKED <layout> <group>` and releases the groups; `WORKER DONE` at the end. Any wrong result
raises, so the worker exits non-zero. (The exact checks of every collective, byte counters and
the timeout are the integration tests' worker, `tests/integration/workers/groups_worker.py`.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import paddle

from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    destroy_groups,
    init_distributed,
    reduce_scatter_chunks,
    shutdown,
)


def _topology(text: str) -> tuple[int, int, int]:
    dp, pp, cp = (int(v) for v in text.lower().split("x"))
    return dp, pp, cp


def _eq(name: str, got: paddle.Tensor, want: np.ndarray) -> None:
    if not np.array_equal(got.cpu().numpy(), want):
        raise AssertionError(f"{name}: got {got.numpy().tolist()} want {want.tolist()}")


def stress(dims: ParallelDims, rank: int) -> str:
    """Build `dims`' groups, run the two collectives on each, release them; the layout."""
    groups = build_groups(dims)
    for dim in ("world", "dp", "pp", "cp"):
        group = groups[dim]
        want = dims.group_ranks(dim, rank)
        if group.ranks != want or group.rank != want.index(rank):
            raise AssertionError(f"{dim}: got {group!r}, want ranks {want}")
        if group.is_trivial:
            continue
        out = all_reduce_tensor(paddle.to_tensor([float(rank)]), group)
        _eq(f"stress all_reduce {group.label}", out, np.array([float(sum(want))], "float32"))
        chunks = [paddle.full([2], float(rank), dtype="float32") for _ in want]
        out = reduce_scatter_chunks(chunks, group)
        _eq(
            f"stress ring reduce_scatter {group.label}",
            out,
            np.full([2], float(sum(want)), "float32"),
        )
        print(f"CHECKED {dims.describe()} {group.label}", flush=True)
    described = groups.describe()
    destroy_groups(groups)
    return described


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", action="append", default=[], type=_topology)
    args = parser.parse_args(argv)

    started = time.monotonic()
    env = init_distributed()
    print(f"INIT rank {env.rank}/{env.world_size} in {time.monotonic() - started:.2f}s", flush=True)
    summary = [
        stress(ParallelDims(dp=dp, pp=pp, cp=cp, world_size=env.world_size), env.rank)
        for dp, pp, cp in args.topology
    ]
    shutdown()
    print("RESULT " + json.dumps({"rank": env.rank, "groups": summary}), flush=True)
    print(f"WORKER DONE in {time.monotonic() - started:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
