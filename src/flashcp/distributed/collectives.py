"""Collectives that work on gloo (CPU) and NCCL, each with a timeout and byte counters.

All functions take an explicit group (a `paddle.distributed.communication.group.Group`, normally
one returned by `build_groups`) - never `None`, which Paddle would read as "the whole world".
A group of one rank is valid and makes every call a local no-op (no traffic, no waiting).

Every call that waits is run under the process watchdog (`watchdog.WATCHDOG`): if it does not
finish within the timeout (argument, else `FLASHCP_COLLECTIVE_TIMEOUT`, default 300 s) the
process prints e.g. "all_gather on group cp[0,1] timed out after 30 s on rank 0: rank 1 may be
dead, hung or skipped this collective" and exits with status 124. On NCCL the call returns once
the collective is queued; its task goes to the watchdog, which polls its completion off the
training thread (`watch`), so no collective drains the device.

Gloo in Paddle 3.3.1 has no reduce_scatter / alltoall, and a send blocks until the peer posts
the matching receive, so the point-to-point algorithms here order each send/recv pair (one side
of every pair sends first) instead of posting both at once.

Results are plain tensors, outside autograd: wrap them in a `PyLayer` to differentiate.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from math import gcd
from typing import TYPE_CHECKING, Any, Literal

import paddle
import paddle.distributed as dist

from flashcp.distributed import check
from flashcp.distributed.counters import COUNTERS
from flashcp.distributed.watchdog import ENV_TIMEOUT, WATCHDOG, resolve_timeout, sync_collectives
from flashcp.log import process_rank

if TYPE_CHECKING:
    from paddle import Tensor
    from paddle.distributed.communication.group import Group

ReduceScatterMethod = Literal["auto", "nccl", "allreduce", "ring"]
REDUCE_SCATTER_METHODS: tuple[str, ...] = ("auto", "nccl", "allreduce", "ring")
ENV_REDUCE_SCATTER = "FLASHCP_REDUCE_SCATTER"


# -- group helpers ----------------------------------------------------------------------------


def group_label(group: Group) -> str:
    """Human label used in messages and counters, e.g. `cp[0,1]`."""
    label = getattr(group, "label", None)
    if isinstance(label, str) and label:
        return label
    name = group.name or f"group{group.id}"
    return f"{name}[{','.join(str(r) for r in group.ranks)}]"


def group_backend(group: Group) -> str:
    """Lower-case backend of `group` ("gloo", "nccl", ...) or "none" for a one-rank group."""
    pg = group.process_group
    return "none" if pg is None else str(pg.name()).lower()


def _check_group(group: Group | None, op: str) -> Group:
    if group is None:
        raise TypeError(
            f"{op} needs an explicit group (e.g. groups.cp); None would mean the whole world"
        )
    if group.rank < 0:
        raise ValueError(
            f"{op}: rank {process_rank()} is not a member of group {group_label(group)}"
        )
    return group


def _peers_text(group: Group) -> str:
    me = process_rank()
    peers = [r for r in group.ranks if r != me]
    if len(peers) == 1:
        return f"rank {peers[0]} may be dead, hung or skipped this collective"
    return f"one of ranks {', '.join(map(str, peers))} may be dead, hung or skipped this collective"


def timeout_message(op: str, group: Group, seconds: float) -> str:
    """The text printed when `op` on `group` exceeds `seconds`."""
    return (
        f"[flashcp] {op} on group {group_label(group)} timed out after {seconds:g} s on rank "
        f"{process_rank()}: {_peers_text(group)} (set {ENV_TIMEOUT} or pass timeout= to wait "
        "longer)"
    )


class Watched:
    """The body of a `watch` block hands the tasks its `paddle.distributed` calls return to
    `task` (None is ignored: gloo and host-side calls need nothing more)."""

    def __init__(self) -> None:
        self.tasks: list[Any] = []

    def task(self, task: Any) -> None:
        if task is not None:
            self.tasks.append(task)


def _drain_device() -> None:
    """Block the host until the current device finished its queued work (debug mode only)."""
    paddle.device.synchronize()


@contextmanager
def watched(group: Group, seconds: float, message: str | Callable[[], str]) -> Iterator[Watched]:
    """Run the block under the watchdog (`seconds`, `message`: the text, or a function that
    builds it when a deadline passes), up to the end of its NCCL work.

    An NCCL call returns once the collective is queued: with `sync_op=True` Paddle's
    `task.wait()` only makes the compute stream wait for the communication stream
    (`ProcessGroupNCCL::NCCLTask::Wait`), so a hung collective would never block the block
    itself. The tasks the block hands over are tracked instead (`Watchdog.track`: the
    watchdog thread polls `task.is_completed()`, a CUDA event query) — the device is never
    drained. Debug mode (`FLASHCP_SYNC_COLLECTIVES=1`) drains it inside the armed block, so a
    hang stops at the call with its host stack. Gloo calls are synchronous already. The time
    the block took is added to this process's waiting time (`counters.waited_seconds`).
    """
    body = Watched()
    nccl = group_backend(group) == "nccl"
    drain = nccl and sync_collectives()
    start = time.perf_counter()
    with WATCHDOG.watch(seconds, message):
        yield body
        if drain:
            _drain_device()
    COUNTERS.add_wait(time.perf_counter() - start)
    if nccl and not drain and body.tasks:
        queue = group_label(group)

        def queued() -> str:
            return (message if isinstance(message, str) else message()) + QUEUED_NOTE

        for task in body.tasks:
            WATCHDOG.track(queue, task.is_completed, seconds, queued)


QUEUED_NOTE = " (NCCL: queued on the device and not completed)"
"""Appended to the timeout message of tracked NCCL work."""


@contextmanager
def watch(op: str, group: Group, timeout: float | None = None) -> Iterator[Watched]:
    """`watched` with the standard timeout message for `op` on `group` (built only if the
    deadline passes: formatting it every call cost more than the call's own bookkeeping)."""
    seconds = resolve_timeout(timeout)
    with watched(group, seconds, lambda: timeout_message(op, group, seconds)) as body:
        yield body


def nbytes(x: Tensor) -> int:
    """Payload size of `x` in bytes (from its shape: `Tensor.size` costs ~20 µs a call)."""
    return math.prod(x.shape) * int(x.element_size())


def _record(op: str, group: Group, sent: float, received: float) -> None:
    COUNTERS.record(op, group_label(group), sent=int(sent), received=int(received))


# -- library collectives ----------------------------------------------------------------------


def barrier(group: Group, *, timeout: float | None = None, op: str = "barrier") -> None:
    """Block until every rank of `group` arrives (`op` names the barrier in the timeout
    message). On NCCL Paddle's barrier blocks the host itself (`ProcessGroupNCCL::Barrier`)."""
    group = _check_group(group, op)
    if group.nranks == 1:
        return
    check.agree("barrier", group, group_label(group), shown=op, timeout=timeout)
    with watch(op, group, timeout):
        dist.barrier(group=group)
    _record("barrier", group, 0, 0)


def all_gather_tensor(
    x: Tensor, group: Group, axis: int = 0, *, timeout: float | None = None
) -> Tensor:
    """Concatenate every rank's `x` (same shape everywhere) along `axis`, in group-rank order.

    Bytes, counted from the tensors of the transfer itself: received = the nbytes of the parts
    the call returned from the other ranks; sent = nbytes of the `x` handed to the call, once
    per other rank it was delivered to. (With equal shapes both are (p - 1) · nbytes(x).)
    """
    group = _check_group(group, "all_gather")
    p = group.nranks
    if p == 1:
        return x
    check.agree(f"all_gather(axis={axis})", group, group_label(group), [x], timeout=timeout)
    parts: list[Tensor] = []
    with paddle.no_grad(), watch("all_gather", group, timeout) as w:
        w.task(dist.all_gather(parts, x, group=group))
    peers = [part for i, part in enumerate(parts) if i != group.rank]
    _record("all_gather", group, nbytes(x) * len(peers), sum(nbytes(t) for t in peers))
    with paddle.no_grad():
        return paddle.concat(parts, axis=axis)


def all_gather_object(obj: Any, group: Group, *, timeout: float | None = None) -> list[Any]:
    """Every rank's picklable `obj`, in group-rank order (small metadata: names, run info).

    Bytes are not counted (the pickled size is not known to the caller).
    """
    group = _check_group(group, "all_gather_object")
    if group.nranks == 1:
        return [obj]
    check.agree("all_gather_object", group, group_label(group), timeout=timeout)
    out: list[Any] = []
    with watch("all_gather_object", group, timeout):
        dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_tensor(
    x: Tensor, group: Group, *, inplace: bool = False, timeout: float | None = None
) -> Tensor:
    """Sum `x` over `group`; returns the sum (in `x` itself when `inplace`).

    Bytes: sent = received = 2 (p - 1) / p · nbytes(x) (ring all-reduce model).
    """
    group = _check_group(group, "all_reduce")
    p = group.nranks
    out = x if inplace else x.clone()
    if p == 1:
        return out
    check.agree("all_reduce", group, group_label(group), [x], timeout=timeout)
    with paddle.no_grad(), watch("all_reduce", group, timeout) as w:
        w.task(dist.all_reduce(out, group=group))
    _record("all_reduce", group, 2 * (p - 1) * nbytes(x) / p, 2 * (p - 1) * nbytes(x) / p)
    return out


def broadcast_tensor(x: Tensor, src: int, group: Group, *, timeout: float | None = None) -> Tensor:
    """Overwrite `x` on every rank with the value on global rank `src`; returns `x`.

    Bytes (flat model): src sends (p - 1) · nbytes(x); every other rank receives nbytes(x).
    """
    group = _check_group(group, "broadcast")
    p = group.nranks
    if src not in group.ranks:
        raise ValueError(f"broadcast source rank {src} is not in group {group_label(group)}")
    if p == 1:
        return x
    check.agree(f"broadcast(src={src})", group, group_label(group), [x], timeout=timeout)
    with paddle.no_grad(), watch("broadcast", group, timeout) as w:
        w.task(dist.broadcast(x, src=src, group=group))
    if process_rank() == src:
        _record("broadcast", group, (p - 1) * nbytes(x), 0)
    else:
        _record("broadcast", group, 0, nbytes(x))
    return x


# -- ordered point-to-point -------------------------------------------------------------------


def sends_first(index: int, shift: int, size: int) -> bool:
    """Whether group rank `index` sends before receiving in a shift-by-`shift` exchange.

    The permutation i -> i + shift splits into cycles; inside each cycle, ranks at even
    positions send first and odd positions receive first. Every cycle then has a rank that
    receives first, so blocking sends (gloo) cannot all wait on each other.
    """
    step = shift % size
    if step == 0:
        return True
    start = index % gcd(size, step)
    position = 0
    current = start
    while current != index:
        current = (current + step) % size
        position += 1
    return position % 2 == 0


def _exchange(
    send: Tensor,
    dst: int,
    recv: Tensor,
    src: int,
    group: Group,
    first: bool,
    body: Watched,
    recv_group: Group | None = None,
) -> tuple[int, int]:
    """One ordered send/recv pair (the receive on `recv_group` when given, e.g. another pair
    link), their tasks handed to the watched `body`; returns the (sent, received) nbytes of
    the two tensors."""
    frm = group if recv_group is None else recv_group
    if first:
        body.task(dist.send(send, dst=dst, group=group))
        body.task(dist.recv(recv, src=src, group=frm))
    else:
        body.task(dist.recv(recv, src=src, group=frm))
        body.task(dist.send(send, dst=dst, group=group))
    return nbytes(send), nbytes(recv)


def odd_gloo_cycle(group: Group, shift: int = 1) -> bool:
    """Whether a shift-by-`shift` exchange over `group` has cycles of odd length > 1 on gloo.

    Paddle's gloo tags every operation on a group with the group's next sequence number and
    matches a receive only to a send of the same tag. In a cycle each rank makes one send and
    one receive, so the send of rank i and the receive of rank i + shift must share a position
    (first or second): the positions alternate around the cycle, which an odd cycle cannot do
    (measured: `ring_shift` over 3 gloo ranks times out). NCCL matches by order per peer.
    """
    p = group.nranks
    length = p // gcd(p, shift % p) if shift % p else 1
    return length > 1 and length % 2 == 1 and group_backend(group) != "nccl"


def ring_shift(x: Tensor, group: Group, shift: int = 1, *, timeout: float | None = None) -> Tensor:
    """Send `x` to group rank (r + shift) mod p and return what group rank (r - shift) sent.

    Every rank must pass a tensor of the same shape and dtype. Bytes: nbytes(x) each way
    (ordered send/recv pairs). On gloo, a shift whose cycles have odd length cannot be paired
    (`odd_gloo_cycle`): it goes through `all_gather_tensor` instead, counted as that.
    """
    group = _check_group(group, "ring_shift")
    p = group.nranks
    r = group.rank
    if p == 1 or shift % p == 0:
        return x.clone()
    check.agree(f"ring_shift(shift={shift})", group, group_label(group), [x], timeout=timeout)
    if odd_gloo_cycle(group, shift):
        parts = all_gather_tensor(x.unsqueeze(0), group, timeout=timeout)
        with paddle.no_grad():
            return parts[(r - shift) % p].clone()
    dst = group.ranks[(r + shift) % p]
    src = group.ranks[(r - shift) % p]
    with paddle.no_grad():
        out = paddle.empty_like(x)
        with watch(f"ring_shift(shift={shift})", group, timeout) as w:
            sent, received = _exchange(x, dst, out, src, group, sends_first(r, shift, p), w)
    _record("ring_shift", group, sent, received)
    return out


# -- reduce-scatter ---------------------------------------------------------------------------


def _resolve_method(method: str, group: Group) -> str:
    if method == "auto":
        method = os.environ.get(ENV_REDUCE_SCATTER, "").strip() or "auto"
    if method not in REDUCE_SCATTER_METHODS:
        raise ValueError(
            f"reduce-scatter method {method!r} is unknown: use one of "
            f"{', '.join(REDUCE_SCATTER_METHODS)} (env {ENV_REDUCE_SCATTER})"
        )
    backend = group_backend(group)
    if method == "auto":
        if backend == "nccl":
            return "nccl"
        return "allreduce" if odd_gloo_cycle(group) else "ring"
    if method == "ring" and odd_gloo_cycle(group):
        raise ValueError(
            f"reduce-scatter method 'ring' cannot pair the send/recv of {group_label(group)} "
            f"({group.nranks} gloo ranks, an odd ring): use 'allreduce' or 'auto' "
            f"(env {ENV_REDUCE_SCATTER})"
        )
    if method == "nccl" and backend != "nccl":
        raise ValueError(
            f"reduce-scatter method 'nccl' needs an NCCL group, but {group_label(group)} is "
            f"{backend}: use 'ring' or 'allreduce'"
        )
    return method


def _check_chunks(chunks: Sequence[Tensor], p: int, group: Group) -> None:
    if len(chunks) != p:
        raise ValueError(
            f"reduce_scatter_chunks got {len(chunks)} chunks for group {group_label(group)} of "
            f"{p} ranks: pass exactly one chunk per rank"
        )
    shape, dtype = list(chunks[0].shape), chunks[0].dtype
    for i, chunk in enumerate(chunks):
        if list(chunk.shape) != shape or chunk.dtype != dtype:
            raise ValueError(
                f"reduce-scatter chunk {i} has shape {list(chunk.shape)} / {chunk.dtype}, but "
                f"chunk 0 has {shape} / {dtype}: all chunks must match"
            )


def _ring_reduce_scatter(
    chunks: Sequence[Tensor], group: Group, body: Watched
) -> tuple[Tensor, int, int]:
    """p - 1 steps; at step s rank r passes its partial sum of chunk (r - 1 - s) to r + 1.

    Returns my reduced chunk and the (sent, received) nbytes of every send/recv it made.
    """
    p, r = group.nranks, group.rank
    right, left = group.ranks[(r + 1) % p], group.ranks[(r - 1) % p]
    first = sends_first(r, 1, p)
    acc = list(chunks)
    buf = paddle.empty_like(chunks[0])
    sent = received = 0
    for step in range(p - 1):
        send_idx = (r - 1 - step) % p
        recv_idx = (r - 2 - step) % p
        s, n = _exchange(acc[send_idx], right, buf, left, group, first, body)
        sent, received = sent + s, received + n
        acc[recv_idx] = acc[recv_idx] + buf
    return acc[r], sent, received


def reduce_scatter_chunks(
    chunks: Sequence[Tensor],
    group: Group,
    *,
    method: ReduceScatterMethod = "auto",
    timeout: float | None = None,
) -> Tensor:
    """Sum over ranks of the chunk destined to me: `chunks[i]` goes to group rank i.

    Methods: "nccl" (the library reduce_scatter, NCCL groups only), "ring" (ordered send/recv,
    p - 1 steps, moves the theoretical (p - 1) / p of the input each way), "allreduce"
    (all-reduce the stacked chunks and keep mine: simple, 2x the bytes). "auto" picks "nccl" on
    NCCL, "ring" on gloo, and "allreduce" on an odd gloo group (`odd_gloo_cycle`); env
    `FLASHCP_REDUCE_SCATTER` overrides "auto".

    Bytes: "ring" counts the nbytes of every tensor its send/recv calls move; "nccl" and
    "allreduce" hand the whole transfer to the library, so they count its bandwidth-optimal
    model ((p - 1) / p, resp. 2 (p - 1) / p, of the tensors handed to it).
    """
    group = _check_group(group, "reduce_scatter")
    p = group.nranks
    _check_chunks(chunks, p, group)
    if p == 1:
        return chunks[0].clone()
    chosen = _resolve_method(method, group)
    check.agree("reduce_scatter", group, group_label(group), chunks, timeout=timeout)
    with paddle.no_grad(), watch(f"reduce_scatter[{chosen}]", group, timeout) as w:
        if chosen == "nccl":
            out = paddle.empty_like(chunks[0])
            w.task(dist.reduce_scatter(out, list(chunks), group=group))
            sent = received = (p - 1) * sum(nbytes(c) for c in chunks) / p
        elif chosen == "allreduce":
            stacked = paddle.stack(list(chunks))
            w.task(dist.all_reduce(stacked, group=group))
            out = stacked[group.rank].clone()
            sent = received = 2 * (p - 1) * nbytes(stacked) / p
        else:
            out, sent, received = _ring_reduce_scatter(chunks, group, w)
    _record("reduce_scatter", group, sent, received)
    return out


def reduce_scatter(
    tensor_or_chunks: Tensor | Sequence[Tensor],
    group: Group,
    *,
    axis: int = 0,
    method: ReduceScatterMethod = "auto",
    timeout: float | None = None,
) -> Tensor:
    """`reduce_scatter_chunks` on a chunk list, or on a tensor cut into p equal parts on `axis`."""
    if isinstance(tensor_or_chunks, list | tuple):
        chunks = list(tensor_or_chunks)
    else:
        group = _check_group(group, "reduce_scatter")
        size = tensor_or_chunks.shape[axis]
        if size % group.nranks:
            raise ValueError(
                f"reduce_scatter: axis {axis} has size {size}, not divisible by the "
                f"{group.nranks} ranks of {group_label(group)}"
            )
        chunks = paddle.split(tensor_or_chunks, group.nranks, axis=axis)
    return reduce_scatter_chunks(chunks, group, method=method, timeout=timeout)
