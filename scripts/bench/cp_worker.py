"""Worker of `scripts/bench_cp.py` (`bench.cp`, parts `comm`, `scaling` and `balance_time`): one
launched CP process.

Run under `paddle.distributed.launch` with N processes (N = cp degree; N = 1 is the CP=1
baseline: the same `flashmask_attention_cp` call on a one-rank cp group, whose gather and
reduce-scatter are local no-ops). Every rank builds the same global q/k/v/dout (one seed),
keeps its shard in the layout of the CP mode and runs forward and backward under a global
causal mask. Results go to `<out>/rank<r>.json`; any error raises (non-zero exit).

Tasks:

* `comm`: for each mode, one forward and one backward, each bracketed by a barrier and a reset
  of flashcp's byte counters (`comm_stats`), so the bytes of exactly one attention call in
  each direction are recorded, per collective. Two independent instruments run alongside:
  a `TransportTap` wrapping `paddle.distributed.send` / `recv` / `all_gather` (the calls that
  move the data) sums the nbytes of the tensors actually handed to and returned by them, and
  the kernel-level bytes this process passed to write system calls (`wchar` of
  `/proc/self/io`: gloo's socket traffic with its framing, plus anything else the process
  writes in that window).
* `time`: `--warmup` + `--repeats` forward+backward iterations, each started after a barrier.
  Wall time of forward and of backward, the process's CPU time, and the time spent inside the
  collectives `flashmask_attention_cp` calls (its module's `all_gather_tensor` and
  `reduce_scatter_chunks` are wrapped with timers here; that time includes waiting for a
  slower peer) and in planning (`plan_cp_attention`: validation, mask rebasing). Afterwards
  the same collectives are timed on their own, each after a barrier (pure transfer cost).
  Over the timed (non-warm-up) iterations the machine's busy cores (`/proc/stat`, every
  process on the machine) and this process's CPU time are recorded, to show the load.
* `balance`: for each mask family (`bench.cp.SCENARIOS`) and CP layout, this rank's OWN
  attention work: its local queries against all keys with the rebased local mask, forward +
  backward through the CPU FlashMask backend, no communication (the K/V a CP rank would gather
  are built locally). `--warmup` + `--repeats` rounds; in each round every case runs once,
  after a barrier, in an order rotated by one case per round (interleaved, so slow periods of
  the machine spread over all cases). Wall and process-CPU seconds per case and round.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

import flashcp.attention.allgather_kv as cp_attention
from bench import machine, stats
from bench.cp import SCENARIOS, layout_for
from bench.rounds import interleave
from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.registry import make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.cp.rebase import rebase_mask
from flashcp.distributed import (
    COUNTERS,
    ParallelDims,
    all_gather_tensor,
    barrier,
    build_groups,
    group_label,
    init_distributed,
    reduce_scatter_chunks,
    reset_comm_stats,
    shutdown,
)
from flashcp.kernels.base import resolve_scale
from flashcp.kernels.registry import get_backend
from flashcp.masks import causal_mask


def tensor_nbytes(x: Any) -> int:
    """Bytes of one tensor's payload, from its own shape and dtype."""
    return int(np.prod(x.shape, dtype=np.int64)) * int(x.element_size())


class TransportTap:
    """Sums the bytes handed to the `paddle.distributed` calls that move tensors.

    While installed (a context manager), `dist.send` / `dist.recv` / `dist.all_gather` are
    wrapped: a send adds its tensor's nbytes to `sent`, a receive the nbytes of the tensor it
    filled to `received`; an all-gather adds the parts it returned from the other ranks to
    `received` and its input once per such part to `sent`. Any other collective
    (`all_reduce`, `broadcast`, `reduce_scatter`, `alltoall`) is counted in `other_calls`, so
    a caller can assert that nothing bypassed the tapped calls.
    """

    MOVING = ("send", "recv", "all_gather")
    OTHER = ("all_reduce", "broadcast", "reduce_scatter", "alltoall")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.calls: dict[str, int] = {}
        self.other_calls = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def tapped(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            self._count(name)
            if name == "send":
                self.sent += tensor_nbytes(args[0] if args else kwargs["tensor"])
            elif name == "recv":
                self.received += tensor_nbytes(args[0] if args else kwargs["tensor"])
            elif name == "all_gather":
                parts = args[0] if args else kwargs["tensor_list"]
                x = args[1] if len(args) > 1 else kwargs["tensor"]
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                mine = int(group.rank) if group is not None else dist.get_rank()
                peers = [t for i, t in enumerate(parts) if i != mine]
                self.received += sum(tensor_nbytes(t) for t in peers)
                self.sent += tensor_nbytes(x) * len(peers)
            else:
                self.other_calls += 1
            return result

        return tapped

    def __enter__(self) -> TransportTap:
        for name in (*self.MOVING, *self.OTHER):
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def totals(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "received": self.received,
            "calls": dict(sorted(self.calls.items())),
            "other_calls": self.other_calls,
        }


class SectionTimer:
    """Accumulates wall seconds per named section; `wrap` times every call of a function."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def total(self, *names: str) -> float:
        return sum(self.seconds.get(n, 0.0) for n in names)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                return fn(*args, **kwargs)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


TIMER = SectionTimer()
COLLECTIVES = ("all_gather", "reduce_scatter")


def install_timers() -> None:
    """Time the collectives and the planning step `flashmask_attention_cp` calls."""
    cp_attention.all_gather_tensor = TIMER.wrap("all_gather", cp_attention.all_gather_tensor)
    cp_attention.reduce_scatter_chunks = TIMER.wrap(
        "reduce_scatter", cp_attention.reduce_scatter_chunks
    )
    cp_attention.plan_cp_attention = TIMER.wrap("plan", cp_attention.plan_cp_attention)


def proc_io() -> dict[str, int]:
    """`rchar` / `wchar` of this process (bytes through read/write-family system calls)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {"rchar": -1, "wchar": -1}
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {"rchar": int(fields["rchar"]), "wchar": int(fields["wchar"])}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int] | None:
    if before["rchar"] < 0 or after["rchar"] < 0:
        return None
    return {
        "sent": after["wchar"] - before["wchar"],
        "received": after["rchar"] - before["rchar"],
    }


def counted(group_name: str) -> dict[str, dict[str, int]]:
    """This rank's counters on the cp group, per collective, plus their `total`."""
    ops: dict[str, dict[str, int]] = {}
    total = {"calls": 0, "sent": 0, "received": 0}
    for (op, group), counter in sorted(COUNTERS.snapshot().items()):
        if group != group_name or op == "barrier":
            continue
        ops[op] = {"calls": counter.calls, "sent": counter.sent, "received": counter.received}
        for key in total:
            total[key] += ops[op][key]
    ops["total"] = total
    return ops


class Problem:
    """Global inputs (same on every rank) and this rank's shards for one CP mode."""

    def __init__(self, args: argparse.Namespace, group: Any) -> None:
        self.args = args
        self.group = group
        self.world = int(group.nranks)
        self.rank = int(group.rank)
        b, s, h, hkv, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
        rng = np.random.default_rng(args.seed)
        dtype = np.dtype(args.dtype)
        self.q = rng.standard_normal((b, s, h, d), dtype=np.float32).astype(dtype)
        self.k = rng.standard_normal((b, s, hkv, d), dtype=np.float32).astype(dtype)
        self.v = rng.standard_normal((b, s, hkv, d), dtype=np.float32).astype(dtype)
        self.dout = rng.standard_normal((b, s, h, d), dtype=np.float32).astype(dtype)
        self.mask = causal_mask(b, s).indices

    def shards(self, mode: str) -> tuple[paddle.Tensor, ...]:
        """Leaf q, k, v (requiring grad) and dout: this rank's shard in `mode`'s layout."""
        asg = make_assignment(mode, self.world, self.mask, causal=True)
        q, k, v = (
            paddle.to_tensor(shard_assigned(x, self.rank, asg, axis=1), stop_gradient=False)
            for x in (self.q, self.k, self.v)
        )
        dout = paddle.to_tensor(shard_assigned(self.dout, self.rank, asg, axis=1))
        return q, k, v, dout

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mode: str) -> Any:
        return flashmask_attention_cp(q, k, v, self.mask, group=self.group, causal=True, mode=mode)


def sync(group: Any) -> None:
    if group.nranks > 1:
        barrier(group)


def task_comm(problem: Problem, modes: list[str]) -> list[dict[str, Any]]:
    """Bytes of one forward and one backward per mode: counters, transport tap, syscalls."""
    label = group_label(problem.group)
    cases = []
    for mode in modes:
        q, k, v, dout = problem.shards(mode)
        sync(problem.group)
        reset_comm_stats()
        io0 = proc_io()
        with TransportTap() as tap_fwd:
            out = problem.forward(q, k, v, mode)
        io1 = proc_io()
        fwd = counted(label)
        sync(problem.group)
        reset_comm_stats()
        io2 = proc_io()
        with TransportTap() as tap_bwd:
            out.backward(dout)
        io3 = proc_io()
        bwd = counted(label)
        assert q.grad is not None and k.grad is not None and v.grad is not None
        cases.append(
            {
                "mode": mode,
                "forward": {
                    "counters": fwd,
                    "transport": tap_fwd.totals(),
                    "syscalls": io_delta(io0, io1),
                },
                "backward": {
                    "counters": bwd,
                    "transport": tap_bwd.totals(),
                    "syscalls": io_delta(io2, io3),
                },
                "checksum": float(out.sum()) + float(k.grad.sum()),
            }
        )
        print(f"COMM mode={mode} fwd={fwd['total']} bwd={bwd['total']}", flush=True)
    return cases


def task_time(problem: Problem, mode: str, warmup: int, repeats: int) -> dict[str, Any]:
    """Per-iteration forward/backward wall time, CPU time, collective and planning time."""
    install_timers()
    q, k, v, dout = problem.shards(mode)
    iterations = []
    window: dict[str, Any] = {}
    for it in range(warmup + repeats):
        if it == warmup:
            window["start"] = (time.perf_counter(), time.process_time(), machine.cpu_jiffies())
        sync(problem.group)
        TIMER.reset()
        c0, t0 = time.process_time(), time.perf_counter()
        out = problem.forward(q, k, v, mode)
        t1 = time.perf_counter()
        comm_fwd = TIMER.total(*COLLECTIVES)
        out.backward(dout)
        t2 = time.perf_counter()
        c1 = time.process_time()
        comm_total = TIMER.total(*COLLECTIVES)
        iterations.append(
            {
                "warmup": it < warmup,
                "forward": t1 - t0,
                "backward": t2 - t1,
                "total": t2 - t0,
                "cpu": c1 - c0,
                "comm_forward": comm_fwd,
                "comm_backward": comm_total - comm_fwd,
                "plan": TIMER.total("plan"),
            }
        )
        print(f"ITER {it} " + json.dumps(iterations[-1]), flush=True)
        for t in (q, k, v):
            t.clear_gradient()
        del out
    wall0, cpu0, (busy0, total0, ncpu) = window["start"]
    busy1, total1, _ = machine.cpu_jiffies()
    measured = {
        "wall": time.perf_counter() - wall0,
        "process_cpu": time.process_time() - cpu0,
        "busy_cores": (busy1 - busy0) / (total1 - total0) * ncpu if total1 > total0 else None,
        "ncpu": ncpu,
        "loadavg": machine.loadavg(),
    }
    return {
        "mode": mode,
        "iterations": iterations,
        "window": measured,
        "isolated": isolated_collectives(problem),
    }


def isolated_collectives(problem: Problem, repeats: int = 3) -> dict[str, float] | None:
    """Median seconds of the forward's and the backward's collectives alone, after a barrier."""
    group = problem.group
    if group.nranks == 1:
        return None
    p = group.nranks
    local = problem.k.shape[1] // p
    b, hkv, d = problem.args.batch, problem.args.kv_heads, problem.args.head_dim
    kv = paddle.to_tensor(np.ones((b, local, hkv, d), dtype=problem.args.dtype))
    full = [paddle.to_tensor(np.ones((b, local, hkv, d), dtype=problem.args.dtype))] * p
    fwd, bwd = [], []
    for _ in range(repeats):
        barrier(group)
        t0 = time.perf_counter()
        all_gather_tensor(kv, group, axis=1)
        all_gather_tensor(kv, group, axis=1)
        fwd.append(time.perf_counter() - t0)
        barrier(group)
        t0 = time.perf_counter()
        all_gather_tensor(kv, group, axis=1)
        all_gather_tensor(kv, group, axis=1)
        reduce_scatter_chunks(full, group)
        reduce_scatter_chunks(full, group)
        bwd.append(time.perf_counter() - t0)
    return {"forward": stats.median(fwd), "backward": stats.median(bwd)}


def task_balance(args: argparse.Namespace, group: Any) -> list[dict[str, Any]]:
    """Per (family, layout): this rank's local attention fwd+bwd seconds in every round."""
    world, rank = int(group.nranks), int(group.rank)
    b, s, h, d = args.batch, args.seq_len, args.heads, args.head_dim
    rng = np.random.default_rng(args.seed)
    q, k, v, dout = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(4))
    k_all, v_all = paddle.to_tensor(k), paddle.to_tensor(v)
    backend = get_backend(2, "cpu")
    scale = resolve_scale(None, d)
    cases = []
    for family in args.families:
        mask = SCENARIOS[family](b, s, 1, args.seed)
        for mode in args.layouts:
            asg = layout_for(mode, mask, world, args.chunks_per_rank, args.block)
            local = rebase_mask(
                mask.indices, causal=mask.causal, assignment_or_positions=asg, rank=rank
            )
            cases.append(
                {
                    "family": family,
                    "mode": mode,
                    "chunks_per_rank": asg.chunks_per_rank,
                    "q": paddle.to_tensor(shard_assigned(q, rank, asg, axis=1)),
                    "dout": paddle.to_tensor(shard_assigned(dout, rank, asg, axis=1)),
                    "mask": np.ascontiguousarray(local, dtype=np.int32),
                    "wall": [],
                    "cpu": [],
                }
            )
    for rnd in interleave(cases, args.repeats, warmup=args.warmup):
        for case in rnd.order:
            barrier(group)
            c0, t0 = time.process_time(), time.perf_counter()
            out, lse = backend.forward(
                case["q"], k_all, v_all, case["mask"], causal=False, softmax_scale=scale
            )
            backend.backward(
                case["q"], k_all, v_all, out, lse, case["mask"], case["dout"],
                causal=False, softmax_scale=scale,
            )  # fmt: skip
            t1, c1 = time.perf_counter(), time.process_time()
            if rnd.timed:
                case["wall"].append(t1 - t0)
                case["cpu"].append(c1 - c0)
        print(f"BALANCE round {rnd.index} done", flush=True)
    keep = ("family", "mode", "chunks_per_rank", "wall", "cpu")
    return [{key: case[key] for key in keep} for case in cases]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--task", choices=("comm", "time", "balance"), required=True)
    p.add_argument("--out", required=True, help="directory for rank<r>.json")
    p.add_argument("--modes", nargs="+", default=["dualchunk_allgather"])
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed iterations (balance: rounds)")
    p.add_argument("--families", nargs="+", default=["causal"], help="balance: mask families")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "dualchunk", "workload_balanced"])
    p.add_argument("--chunks-per-rank", type=int, default=4, help="balance: workload_balanced k")
    p.add_argument("--block", type=int, default=128, help="balance: tile size of the model")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    env = init_distributed()
    world = env.world_size
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=world, world_size=world))
    rank = int(groups.cp.rank)
    report: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "task": args.task,
        "group": group_label(groups.cp),
    }
    if args.task == "balance":
        report["cases"] = task_balance(args, groups.cp)
    elif args.task == "comm":
        report["cases"] = task_comm(Problem(args, groups.cp), args.modes)
    else:
        problem = Problem(args, groups.cp)
        report["timing"] = task_time(problem, args.modes[0], args.warmup, args.repeats)
    report["loadavg"] = machine.loadavg()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"BENCH WORKER DONE rank={rank} task={args.task}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
