"""Point-to-point send / receive of one tensor, with a watchdog timeout and byte counters.

The pipeline schedule (`flashcp.pipeline.runner`) moves activations and gradients between
adjacent stages with these. Both sides know the tensor's shape and dtype in advance (they
follow from the micro-batch shape and the hidden size), so nothing but the payload travels.

On gloo a `send` blocks until the peer posts the matching `recv` (and the other way round):
two ranks that both send to each other first deadlock. Callers must order every pair of
operations so that the two sides agree; `flashcp.pipeline.runner` derives such an order.

`src` / `dst` are GLOBAL ranks, members of `group` (as for `paddle.distributed.send`). Each call
runs under the process watchdog: past the timeout (argument, else `FLASHCP_COLLECTIVE_TIMEOUT`,
default 300 s) the process prints which peer it waited for and exits with status 124.

Gloo tags: Paddle's `ProcessGroupGloo` gives every operation on a group the group's next tag
(one counter per group and process), and a send only matches a receive with the same tag. In a
group of more than two ranks where different PAIRS exchange different numbers of messages (the
middle stages of a pipeline of 3+ stages) the counters drift apart and the transfer hangs.
`pipeline_links` therefore gives each pair of ranks that talk (adjacent stages, and the first
and last stage for tied embeddings) its own two-rank gloo group on a dedicated TCPStore, as
`build_groups` does for the mesh groups; both ends of a pair then do the same operations in the
same order and the tags agree. A pp group of two ranks, and NCCL groups (no tags), are used
as they are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import paddle
import paddle.distributed as dist

from flashcp.distributed import check
from flashcp.distributed.collectives import group_backend, group_label, nbytes, watched
from flashcp.distributed.counters import COUNTERS
from flashcp.distributed.groups import NamedGroup, ParallelGroups, store_group
from flashcp.distributed.watchdog import ENV_TIMEOUT, WATCHDOG, resolve_timeout
from flashcp.log import logger, process_rank

if TYPE_CHECKING:
    from paddle import Tensor
    from paddle.distributed.communication.group import Group


def _check_peer(op: str, peer: int, group: Group) -> None:
    if group is None:
        raise TypeError(f"{op} needs an explicit group (e.g. groups.pp)")
    me = process_rank()
    if group.rank < 0:
        raise ValueError(f"{op}: rank {me} is not a member of group {group_label(group)}")
    if peer not in group.ranks:
        raise ValueError(f"{op}: peer rank {peer} is not in group {group_label(group)}")
    if peer == me:
        raise ValueError(f"{op}: rank {me} cannot exchange a tensor with itself")


def p2p_timeout_message(op: str, peer: int, group: Group, seconds: float) -> str:
    """The text printed when `op` with `peer` on `group` exceeds `seconds`."""
    return (
        f"[flashcp] {op} on group {group_label(group)} timed out after {seconds:g} s on rank "
        f"{process_rank()}: rank {peer} may be dead, hung, or waiting on a different operation "
        f"(mismatched send/recv order) (set {ENV_TIMEOUT} or pass timeout= to wait longer)"
    )


@dataclass(frozen=True)
class _Spec:
    """The shape and dtype a receive expects (as a fingerprint shows a tensor)."""

    shape: Any
    dtype: Any


def _agree(op: str, src: int, dst: int, group: Group, tensor: str, timeout: float | None) -> None:
    """Check mode (`flashcp.distributed.check`): both ends of a transfer on a two-rank group
    agree on its direction, shape and dtype before it is posted."""
    if int(group.nranks) == 2:
        check.agree(f"p2p {src}->{dst}", group, group_label(group), shapes=[tensor], shown=op,
                    timeout=timeout)  # fmt: skip


def send_tensor(x: Tensor, dst: int, group: Group, *, timeout: float | None = None) -> None:
    """Send `x` to global rank `dst` (blocks until `dst` receives it on gloo)."""
    op = f"send(to rank {dst})"
    _check_peer(op, dst, group)
    _agree(op, process_rank(), dst, group, check.tensor_text(x), timeout)
    seconds = resolve_timeout(timeout)
    message = lambda: p2p_timeout_message(op, dst, group, seconds)  # noqa: E731 - built if due
    with paddle.no_grad(), watched(group, seconds, message) as w:
        w.task(dist.send(x, dst=dst, group=group))  # NCCL: tracked until the device ran it
    COUNTERS.record("send", group_label(group), sent=nbytes(x), received=0)


def recv_tensor(
    shape: list[int] | tuple[int, ...],
    dtype: Any,
    src: int,
    group: Group,
    *,
    timeout: float | None = None,
) -> Tensor:
    """Receive a tensor of `shape` / `dtype` from global rank `src`; returns a new tensor."""
    op = f"recv(from rank {src})"
    _check_peer(op, src, group)
    _agree(op, src, process_rank(), group, check.tensor_text(_Spec(shape, dtype)), timeout)
    seconds = resolve_timeout(timeout)
    with paddle.no_grad():
        out = paddle.empty(list(shape), dtype=dtype)
        message = lambda: p2p_timeout_message(op, src, group, seconds)  # noqa: E731
        with watched(group, seconds, message) as w:
            w.task(dist.recv(out, src=src, group=group))
    COUNTERS.record("recv", group_label(group), sent=0, received=nbytes(out))
    return out


def swap_tensor(
    x: Tensor, peer: int, group: Group, *, send_first: bool, timeout: float | None = None
) -> Tensor:
    """Send `x` to `peer` and receive a tensor of the same shape / dtype back from it.

    Exactly one of the two sides must pass `send_first=True` (gloo sends block).
    """
    if send_first:
        send_tensor(x, peer, group, timeout=timeout)
        return recv_tensor(x.shape, x.dtype, peer, group, timeout=timeout)
    out = recv_tensor(x.shape, x.dtype, peer, group, timeout=timeout)
    send_tensor(x, peer, group, timeout=timeout)
    return out


# -- dedicated two-rank groups for the pipeline's point-to-point links ---------------------------

LINK_ID_BASE = 1 << 24
"""Group ids of pipeline link groups start here, above `build_groups`' ids."""
_LINK_KEY = "flashcp/p2p/{build}/{a}-{b}"


@dataclass(frozen=True)
class PipelineLinks:
    """The groups this rank uses to talk to its pipeline neighbours (None: no such peer).

    `prev` / `next`: the stages before / after this one; `ends`: first <-> last stage (tied
    embeddings), set only on those two stages when pp > 1. Each group holds both peers.
    """

    prev: Group | None
    next: Group | None
    ends: Group | None


_links: dict[int, tuple[ParallelGroups, PipelineLinks, int]] = {}
_link_builds = itertools.count()
"""Numbers each set of links; every rank builds its links for the same `ParallelGroups` in the
same order (as it builds the groups themselves), so the number agrees between peers and keeps
store keys and group ids of a later rebuild distinct from earlier ones."""


def _link_id(build: int, a: int, b: int, world: int) -> int:
    gid = LINK_ID_BASE + (build * world + a) * world + b
    if gid >= 2**31:
        raise ValueError(f"pipeline link group id {gid} overflows: world {world} is too large")
    return gid


def _link_group(build: int, a: int, b: int, me: int, world: int, timeout: float) -> NamedGroup:
    """The gloo group {a, b} (a < b, `me` one of them) on its own TCPStore; collective for both."""
    key = _LINK_KEY.format(build=build, a=a, b=b)
    gid = _link_id(build, a, b, world)
    return store_group("pp_link", key, [a, b], me, gid, timeout, name=f"flashcp_pp_link_{a}_{b}")


def pipeline_links(
    groups: ParallelGroups, *, tied: bool = False, timeout: float | None = None
) -> PipelineLinks:
    """This rank's pipeline link groups, created on first use (collective for each pair).

    `tied`: also link the first and last stage (tied embeddings); only those two stages get
    `ends`. Gloo with pp > 2 creates two-rank groups (see the module docstring) and registers
    them in `groups.created`, so `destroy_groups` / `shutdown` release them with the mesh
    groups. Otherwise the pp group itself serves every link.
    """
    pp = groups.pp
    p, s = int(pp.nranks), int(pp.rank)
    if p == 1:
        return PipelineLinks(None, None, None)
    ranks = list(pp.ranks)
    tied_end = tied and s in (0, p - 1)
    cached = _links.get(id(groups))
    if cached is not None and cached[0] is not groups:
        cached = None
    if cached is not None and (not tied_end or cached[1].ends is not None):
        return cached[1]
    build = -1
    if p == 2 or group_backend(pp) != "gloo":
        links = PipelineLinks(
            pp if s > 0 else None, pp if s < p - 1 else None, pp if tied_end else None
        )
    else:
        seconds = resolve_timeout(timeout, init=True)
        me, world = groups.rank, groups.dims.world_size
        build = cached[2] if cached is not None else next(_link_builds)

        def make(a: int, b: int) -> NamedGroup:
            message = (
                f"[flashcp] creating pipeline link [{a},{b}] timed out after {seconds:g} s on "
                f"rank {me}: the peer did not join (crashed, or a different parallel.pp?)"
            )
            with WATCHDOG.watch(seconds, message):
                group = _link_group(build, a, b, me, world, seconds)
            groups.created.append(group)
            return group

        # Order: previous link, next link, then first <-> last. A rank only ever waits for a
        # lower stage to reach a link that stage creates earlier, so creations cannot cycle.
        if cached is not None:
            prev, nxt = cached[1].prev, cached[1].next
        else:
            prev = make(ranks[s - 1], ranks[s]) if s > 0 else None
            nxt = make(ranks[s], ranks[s + 1]) if s < p - 1 else None
        ends = make(ranks[0], ranks[-1]) if tied_end else None
        links = PipelineLinks(prev, nxt, ends)
        logger.debug("rank %d: pipeline links %s", me, links)
    _links[id(groups)] = (groups, links, build)
    return links
