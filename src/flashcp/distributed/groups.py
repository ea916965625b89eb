"""Build the dp / pp / cp process groups of a `ParallelDims` layout.

NCCL: plain `paddle.distributed.new_group`, called by every rank for every group in the same
order (Paddle numbers groups by call order).

Gloo (CPU): `new_group` over gloo shares the job's one TCPStore between all sub-groups and, with
four processes, fails most runs (connection refused, store timeouts, hangs). Here each gloo
sub-group gets its *own* TCPStore instead: the group's lowest rank picks a free port, starts the
store on it, and publishes `host:port` under a per-group key of the world store; the other
members read the key, wait until the port accepts, and join. The `ProcessGroupGloo` built on that
store is wrapped as a Paddle `Group`, so `paddle.distributed.all_gather(..., group=g)` and
friends accept it. Only the members of a group take part in creating it.

A dimension of degree 1 gets a one-rank "trivial" group (never `None`: Paddle reads
`group=None` as the whole world). A group spanning every rank reuses the world process group.

Expert parallelism (`ParallelDims.ep` > 1) adds two groups per rank, built the same way after
the mesh groups: `ep` (the ranks exchanging tokens, `flashcp.distributed.alltoall`) and `edp`
(the ranks holding the same experts, over which expert gradients are summed). On gloo with an
ep group of more than two ranks, every pair of its ranks also gets a two-rank group on its own
store (`ParallelGroups.ep_links`): Paddle's gloo gives each operation on a group the group's
next tag and a receive only matches a send of the same tag, so pairwise exchanges inside a
larger group hang whenever the pairs' operation counts drift (an odd cycle of a shifted
exchange; measured: `ring_shift` over 3 gloo ranks times out). Pair groups keep both ends of
every transfer in step, whatever the group size.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paddle.distributed as dist
from paddle.distributed.communication.group import Group

from flashcp.distributed import ports
from flashcp.distributed.alltoall import Exchange
from flashcp.distributed.collectives import barrier, group_backend
from flashcp.distributed.dims import DIM_ORDER, GROUP_KINDS, WORLD, ParallelDims, kind_groups
from flashcp.distributed.watchdog import WATCHDOG, resolve_timeout
from flashcp.log import logger

GROUP_ID_BASE = 4096
"""Group ids of flashcp gloo groups start here, far above Paddle's own ring ids."""
_STORE_KEY = "flashcp/groups/{build}/{dim}/{index}"
_PORT_ATTEMPTS = 5
EP_LINK_ID_BASE = 1 << 26
"""Group ids of the ep pair groups (gloo) start here, above the pipeline links' ids."""
_EP_LINK_KEY = "flashcp/ep_link/{build}/{a}-{b}"


class NamedGroup(Group):
    """A Paddle `Group` that also knows which mesh dimension it is (`dim`) and its `label`."""

    def __init__(
        self,
        dim: str,
        rank_in_group: int,
        group_id: int,
        ranks: list[int],
        pg: Any = None,
        name: str | None = None,
        store: Any = None,
    ) -> None:
        super().__init__(rank_in_group, group_id, list(ranks), pg=pg, name=name or dim)
        self.dim = dim
        self._store = store  # keeps a dedicated TCPStore alive as long as the group

    @property
    def label(self) -> str:
        return f"{self.dim}[{','.join(str(r) for r in self.ranks)}]"

    @property
    def is_trivial(self) -> bool:
        """One rank: every flashcp collective on it is a local no-op."""
        return self.nranks == 1

    def __repr__(self) -> str:
        return f"NamedGroup({self.label}, rank {self.rank}, backend {group_backend(self)})"


@dataclass
class ParallelGroups:
    """This rank's groups: `.world`, `.dp`, `.pp`, `.cp` (trivial when the degree is 1), and
    for expert parallelism `.ep`, `.edp` and the gloo pair groups `.ep_links` (module doc)."""

    dims: ParallelDims
    rank: int
    world: NamedGroup
    dp: NamedGroup
    pp: NamedGroup
    cp: NamedGroup
    backend: str
    created: list[NamedGroup] = field(default_factory=list)
    ep: NamedGroup = None  # type: ignore[assignment]  # set in __post_init__ when None
    edp: NamedGroup = None  # type: ignore[assignment]
    ep_links: dict[int, NamedGroup] = field(default_factory=dict)
    """Peer global rank → the two-rank group for transfers with it (gloo, ep > 2 only)."""

    def __post_init__(self) -> None:
        # ep = 1: no expert parallelism; the expert groups are trivial and unused (expert
        # weights are then ordinary parameters, summed over cp and dp)
        if self.ep is None:
            self.ep = _trivial("ep", self.rank)
        if self.edp is None:
            self.edp = _trivial("edp", self.rank)

    def __getitem__(self, dim: str) -> NamedGroup:
        if dim != WORLD and dim not in GROUP_KINDS:
            raise KeyError(f"unknown parallel dimension {dim!r}")
        return getattr(self, dim)

    def ep_exchange(self) -> Exchange:
        """The ep group with its pair groups, for `flashcp.distributed.alltoall`."""
        return Exchange(self.ep, dict(self.ep_links))

    def describe(self) -> str:
        kinds = (WORLD, *DIM_ORDER, *(("ep", "edp") if self.dims.ep > 1 else ()))
        parts = [self[d].label for d in kinds]
        return f"rank {self.rank} ({self.backend}): " + " ".join(parts)


_build_counter = itertools.count()
_live: list[ParallelGroups] = []


def endpoint_host(rank: int) -> str:
    """The host of global rank `rank` (from PADDLE_TRAINER_ENDPOINTS; 127.0.0.1 if unknown)."""
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "")
    hosts = [e.rsplit(":", 1)[0] for e in endpoints.split(",") if e]
    return hosts[rank] if rank < len(hosts) else "127.0.0.1"


def wait_for_port(host: str, port: int, timeout: float, *, what: str = "server") -> float:
    """Poll until `host:port` accepts a TCP connection; returns the seconds waited.

    Raises `TimeoutError` naming `what` when it does not within `timeout` seconds.
    """
    start = time.monotonic()
    delay = 0.01
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return time.monotonic() - start
        except OSError as exc:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise TimeoutError(
                    f"{what} at {host}:{port} did not accept connections within {timeout:g} s "
                    f"({exc})"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def start_group_store(host: str, size: int, timeout: float) -> tuple[Any, int, threading.Thread]:
    """Start a master TCPStore in a thread (its constructor blocks until all `size` members
    connect); return once the port listens.

    The port is leased (`flashcp.distributed.ports`) until the store listens: outside the
    ephemeral range and locked, so no other process binds it first (Paddle's store aborts the
    process when its bind fails, so a retry here would come too late)."""
    from paddle.base import core

    last_error: BaseException | None = None
    for _ in range(_PORT_ATTEMPTS):
        lease = ports.reserve(1)
        port = lease.first
        box: dict[str, Any] = {}

        def create(port: int = port, box: dict[str, Any] = box) -> None:
            try:
                box["store"] = core.TCPStore(host, port, True, size, int(max(timeout, 1)))
            except BaseException as exc:  # noqa: BLE001 - reported to the caller below
                box["error"] = exc

        thread = threading.Thread(target=create, name=f"flashcp-store-{port}", daemon=True)
        thread.start()
        deadline = time.monotonic() + min(timeout, 30.0)
        try:
            while time.monotonic() < deadline and "error" not in box:
                try:
                    with socket.create_connection((host, port), timeout=0.5):
                        return box, port, thread
                except OSError:
                    time.sleep(0.01)
        finally:
            lease.release()
        thread.join(timeout=0.5)
        last_error = box.get("error", TimeoutError(f"store on port {port} never listened"))
    raise RuntimeError(f"could not start a TCPStore on {host} ({last_error})")


def store_group(
    dim: str,
    key: str,
    ranks: list[int],
    rank: int,
    group_id: int,
    timeout: float,
    *,
    name: str,
) -> NamedGroup:
    """The gloo group of `ranks` (this `rank` is one of them) on its OWN TCPStore.

    Collective for the members only. The lowest-listed rank starts the store on a free port
    (`start_group_store`) and publishes `host:port` under `key` in the job's world store; the
    others read it, wait for the port and join. Used for the mesh groups (`build_groups`) and
    the two-rank pipeline links (`flashcp.distributed.p2p`); `key` and `group_id` must be
    unique per group and agree between its members.
    """
    from paddle.base import core

    world_store = core.create_or_get_global_tcp_store()
    master = ranks[0]
    size = len(ranks)
    what = f"group {dim}{ranks}"
    if rank == master:
        host = endpoint_host(master)
        box, port, thread = start_group_store(host, size, timeout)
        world_store.set(key, f"{host}:{port}")
        thread.join()  # returns once every member has connected
        if "error" in box:
            raise RuntimeError(f"TCPStore for {what} failed: {box['error']}")
        store = box["store"]
    else:
        endpoint = world_store.get(key).decode()
        host, port_text = endpoint.rsplit(":", 1)
        wait_for_port(host, int(port_text), timeout, what=f"store of {what}")
        store = core.TCPStore(host, int(port_text), False, size, int(max(timeout, 1)))
    pg = core.ProcessGroupGloo.create(store, ranks.index(rank), size, group_id)
    return NamedGroup(dim, ranks.index(rank), group_id, ranks, pg=pg, name=name, store=store)


def _gloo_group(
    dim: str, index: int, ranks: list[int], rank: int, build: int, timeout: float
) -> NamedGroup:
    """Create the gloo group `ranks` of kind `dim` (this rank is a member) on its own
    TCPStore."""
    key = _STORE_KEY.format(build=build, dim=dim, index=index)
    group_id = GROUP_ID_BASE + build * len(GROUP_KINDS) + GROUP_KINDS.index(dim)
    return store_group(dim, key, ranks, rank, group_id, timeout, name=f"flashcp_{dim}_{index}")


def ep_link_pairs(dims: ParallelDims, backend: str) -> list[tuple[int, int]]:
    """The pairs `(a, b)`, a < b, that get their own two-rank group: every pair of every ep
    group of more than two ranks, on gloo only; sorted, the order every rank creates them in
    (the earliest incomplete pair always has both ranks waiting on it: no deadlock)."""
    if backend != "gloo" or dims.ep <= 2:
        return []
    return sorted(
        (a, b) for ranks in dims.expert_groups_for("ep") for a in ranks for b in ranks if a < b
    )


NewGroupFn = Callable[..., Group]


def _nccl_groups(
    dims: ParallelDims, rank: int, timeout: float, new_group: NewGroupFn
) -> dict[str, NamedGroup]:
    """Every rank calls `new_group` for every group of every enabled kind, in order."""
    mine: dict[str, NamedGroup] = {}
    for dim in GROUP_KINDS:
        for ranks in kind_groups(dims, dim):
            if len(ranks) == dims.world_size:
                continue  # the world group serves
            group = new_group(ranks, backend="nccl", timeout=datetime.timedelta(seconds=timeout))
            if rank in ranks:
                mine[dim] = NamedGroup(
                    dim,
                    ranks.index(rank),
                    group.id,
                    ranks,
                    pg=group.process_group,
                    name=group.name,
                )
    return mine


def _trivial(dim: str, rank: int) -> NamedGroup:
    return NamedGroup(dim, 0, -1, [rank], pg=None, name=f"flashcp_{dim}_self")


def world_group() -> NamedGroup:
    """The whole job as a `NamedGroup` (trivial when not launched or not initialised)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _trivial(WORLD, 0)
    from paddle.distributed.collective import _get_default_group

    default = _get_default_group()
    return NamedGroup(
        WORLD,
        default.rank,
        default.id,
        list(default.ranks),
        pg=default.process_group,
        name=default.name,
    )


def build_groups(
    dims: ParallelDims,
    *,
    backend: str = "auto",
    timeout: float | None = None,
    new_group: NewGroupFn | None = None,
) -> ParallelGroups:
    """Create this rank's process groups for `dims` (collective: every rank must call it).

    `backend` "auto" uses the world group's backend. `timeout` (else `FLASHCP_INIT_TIMEOUT`,
    default 300 s) bounds the stores and each group's creation; past it the watchdog ends the
    process with a message naming the group. `new_group` replaces `paddle.distributed.new_group`
    on the NCCL path (tests use a fake).
    """
    seconds = resolve_timeout(timeout, init=True)
    initialized = dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    if world_size != dims.world_size:
        hint = "" if initialized else " (call flashcp.distributed.init_distributed() first)"
        raise ValueError(
            f"ParallelDims is for {dims.world_size} ranks but this process sees a world of "
            f"{world_size}{hint}"
        )
    rank = dist.get_rank() if initialized else 0
    world = world_group()
    if backend == "auto":
        backend = group_backend(world) if world_size > 1 else "none"
    build = next(_build_counter)

    mine: dict[str, NamedGroup] = {}
    created: list[NamedGroup] = []
    links: dict[int, NamedGroup] = {}
    if backend == "nccl":
        mine = _nccl_groups(dims, rank, seconds, new_group or dist.new_group)
    elif backend == "gloo":
        for dim in GROUP_KINDS:
            lists = kind_groups(dims, dim)
            ranks = next((r for r in lists if rank in r), None)
            if ranks is None or len(ranks) == world_size:
                continue
            message = (
                f"[flashcp] creating process group {dim}[{','.join(map(str, ranks))}] timed out "
                f"after {seconds:g} s on rank {rank}: another member did not join (crashed, or "
                "built a different layout?)"
            )
            with WATCHDOG.watch(seconds, message):
                mine[dim] = _gloo_group(dim, lists.index(ranks), ranks, rank, build, seconds)
            created.append(mine[dim])
        for a, b in ep_link_pairs(dims, backend):
            if rank not in (a, b):
                continue
            message = (
                f"[flashcp] creating expert-parallel link [{a},{b}] timed out after {seconds:g} "
                f"s on rank {rank}: the peer did not join (crashed, or a different parallel.ep?)"
            )
            with WATCHDOG.watch(seconds, message):
                link = _ep_link(build, a, b, rank, world_size, seconds)
            links[b if rank == a else a] = link
            created.append(link)
    elif backend != "none":
        raise ValueError(f"backend {backend!r} is not supported: use 'gloo' or 'nccl'")

    handles: dict[str, NamedGroup] = {}
    for dim in GROUP_KINDS:
        spans = kind_groups(dims, dim)
        if dim in mine:
            handles[dim] = mine[dim]
        elif spans:  # spans the whole world
            handles[dim] = NamedGroup(
                dim,
                world.rank,
                world.id,
                list(world.ranks),
                pg=world.process_group,
                name=world.name,
            )
        else:
            handles[dim] = _trivial(dim, rank)
    groups = ParallelGroups(
        dims,
        rank,
        world,
        handles["dp"],
        handles["pp"],
        handles["cp"],
        backend,
        created,
        ep=handles["ep"],
        edp=handles["edp"],
        ep_links=links,
    )
    _live.append(groups)
    logger.debug("built groups: %s", groups.describe())
    return groups


def _ep_link(build: int, a: int, b: int, me: int, world: int, timeout: float) -> NamedGroup:
    """The gloo pair group {a, b} (a < b, `me` one of them) of an ep group, on its own store."""
    gid = EP_LINK_ID_BASE + (build * world + a) * world + b
    if gid >= 2**31:
        raise ValueError(f"expert-parallel link group id {gid} overflows: world {world} too large")
    key = _EP_LINK_KEY.format(build=build, a=a, b=b)
    return store_group("ep_link", key, [a, b], me, gid, timeout, name=f"flashcp_ep_link_{a}_{b}")


def destroy_groups(groups: ParallelGroups, *, timeout: float | None = None) -> None:
    """Release the gloo groups and dedicated stores of `groups` (collective over the world).

    Order matters for a clean exit: all ranks meet, the process groups close, member stores
    disconnect, all ranks meet again, and only then do the master stores stop.
    """
    if groups in _live:
        _live.remove(groups)
    if not groups.created:
        return
    barrier(groups.world, timeout=timeout)
    masters = []
    for group in reversed(groups.created):
        group._pg = None
        if group.ranks[0] == groups.rank:
            masters.append(group._store)
        group._store = None
    barrier(groups.world, timeout=timeout)
    masters.clear()
    groups.created.clear()


def destroy_all_groups(*, timeout: float | None = None) -> None:
    """`destroy_groups` for every `build_groups` result still alive, newest first."""
    for groups in list(reversed(_live)):
        destroy_groups(groups, timeout=timeout)
