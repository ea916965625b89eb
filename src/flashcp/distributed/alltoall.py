"""All-to-all exchange of row blocks inside a group (expert parallelism), on NCCL and gloo.

`all_to_all(x, send_splits, recv_splits, exchange)`: `x` `[sum(send_splits), ...]` is cut along
axis 0 into consecutive blocks, block i (`send_splits[i]` rows) going to group rank i; the
result is the blocks received from group ranks 0, 1, ..., p - 1 (`recv_splits[i]` rows from
rank i) concatenated in that order. Rank r's own block is copied locally, never sent. Every rank
must know both split lists in advance (MoE dispatch exchanges its counts first:
`flashcp.models.expert_parallel`), so only payload travels.

* NCCL: one `paddle.distributed.alltoall_single` with the two split lists.
* gloo (Paddle 3.3.1 has no alltoall for it): p - 1 steps of ordered point-to-point pairs; at
  step s rank r sends block (r + s) mod p and receives from (r - s) mod p, the side that sends
  first chosen by `sends_first` (a gloo send blocks until the peer receives, so both sides
  posting first would deadlock). Transfers to a peer run on the exchange's pair group with that
  peer when it has one (`flashcp.distributed.groups`: gloo ep groups of more than two ranks;
  gloo matches a receive to a send by per-group operation tags, which pairwise exchanges in a
  larger group throw out of step). Empty blocks are sent too (gloo moves 0-byte messages), so
  every pair does the same operations whatever the counts.

Bytes (`flashcp.distributed.counters`, op ``all_to_all``, the group's label) are counted from
the tensors handed to the transfer: sent = the nbytes of the blocks for OTHER ranks, received =
the nbytes of the blocks from other ranks; the local block is not traffic. Every call runs
under the watchdog with the standard timeout message.

`gather_rows(x, exchange, root)` concatenates every rank's equally shaped `x` on one rank only
(checkpoint writers collect the expert weights of their ep group; the others get None), as
ordered sends to the root on the same links.

Results are plain tensors outside autograd (the MoE dispatch wraps `all_to_all` in a PyLayer
whose backward is the reverse exchange).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import paddle
import paddle.distributed as dist

from flashcp.distributed import check
from flashcp.distributed.collectives import (
    Watched,
    _check_group,
    _exchange,
    _record,
    group_backend,
    group_label,
    nbytes,
    sends_first,
    watch,
)

if TYPE_CHECKING:
    from paddle import Tensor
    from paddle.distributed.communication.group import Group


@dataclass(frozen=True, eq=False)
class Exchange:
    """A group and the pair groups its point-to-point transfers use (peer global rank →
    group; a peer without one is reached on `group` itself).

    Shared, never copied: `copy.deepcopy` of a model holding one (the DPO reference copy)
    keeps the same process groups."""

    group: Any
    links: Mapping[int, Any] = field(default_factory=dict)

    @property
    def nranks(self) -> int:
        return int(self.group.nranks)

    @property
    def rank(self) -> int:
        return int(self.group.rank)

    @property
    def label(self) -> str:
        return group_label(self.group)

    def link(self, peer: int) -> Any:
        """The group to exchange with global rank `peer` on."""
        return self.links.get(peer, self.group)

    def __deepcopy__(self, memo: dict[int, Any]) -> Exchange:
        return self


def _check_splits(
    x: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group
) -> tuple[list[int], list[int]]:
    p = int(group.nranks)
    send, recv = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    if len(send) != p or len(recv) != p:
        raise ValueError(
            f"all_to_all on {group_label(group)} ({p} ranks) needs one send and one receive "
            f"count per rank, got {len(send)} and {len(recv)}"
        )
    if min(send + recv) < 0:
        raise ValueError(f"all_to_all: negative counts (send {send}, receive {recv})")
    if sum(send) != int(x.shape[0]):
        raise ValueError(
            f"all_to_all: the send counts {send} add up to {sum(send)} rows but x has "
            f"{int(x.shape[0])}"
        )
    return send, recv


def _blocks(x: Tensor, splits: Sequence[int]) -> list[Tensor]:
    """Row blocks of `x`, each contiguous (gloo's send refuses a strided view, which a slice of
    a non-contiguous `x` is: seen under full recompute)."""
    out, start = [], 0
    for n in splits:
        out.append(x[start : start + n].contiguous())
        start += n
    return out


def all_to_all(
    x: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    exchange: Exchange,
    *,
    timeout: float | None = None,
) -> Tensor:
    """The blocks of `x` sent to, and the blocks received from, every rank (module doc)."""
    group = _check_group(exchange.group, "all_to_all")
    send, recv = _check_splits(x, send_splits, recv_splits, group)
    p, r = int(group.nranks), int(group.rank)
    row = _row_bytes(x)
    if p == 1:
        with paddle.no_grad():
            return x.clone()
    shape = [int(s) for s in x.shape[1:]]
    rows = check.tensor_text(x[:0]).replace("[0", "[*")  # the row shape: counts differ
    check.agree("all_to_all", group, group_label(group), shapes=[rows], timeout=timeout)
    with paddle.no_grad():
        if group_backend(group) == "nccl":
            out = paddle.empty([sum(recv), *shape], dtype=x.dtype)
            with watch("all_to_all", group, timeout) as w:
                w.task(dist.alltoall_single(out, x, send, recv, group=group))
            sent = sum(n for i, n in enumerate(send) if i != r) * row
            received = sum(n for i, n in enumerate(recv) if i != r) * row
        else:
            parts = _blocks(x, send)
            got: list[Tensor | None] = [None] * p
            got[r] = parts[r].clone()
            sent = received = 0
            with watch("all_to_all", group, timeout) as w:
                for step in range(1, p):
                    dst, src = (r + step) % p, (r - step) % p
                    buf = paddle.empty([recv[src], *shape], dtype=x.dtype)
                    s, n = _exchange_on_links(
                        parts[dst], group.ranks[dst], buf, group.ranks[src], exchange,
                        sends_first(r, step, p), w,
                    )  # fmt: skip
                    sent, received = sent + s, received + n
                    got[src] = buf
            out = paddle.concat([t for t in got if t is not None], axis=0)
    _record("all_to_all", group, sent, received)
    return out


def _row_bytes(x: Tensor) -> int:
    rows = 1
    for s in x.shape[1:]:
        rows *= int(s)
    return rows * int(x.element_size())


def _exchange_on_links(
    send: Tensor,
    dst: int,
    recv: Tensor,
    src: int,
    exchange: Exchange,
    first: bool,
    body: Watched,
) -> tuple[int, int]:
    """One ordered send/recv pair, each on the link to its peer; (sent, received) nbytes."""
    return _exchange(send, dst, recv, src, exchange.link(dst), first, body, exchange.link(src))


def gather_rows(
    x: Tensor, exchange: Exchange, *, root: int = 0, timeout: float | None = None
) -> Tensor | None:
    """Every rank's `x` (same shape and dtype everywhere) concatenated along axis 0 in group
    rank order on group rank `root`; None on the others. Bytes: op ``gather``, each non-root
    sends nbytes(x), the root receives (p - 1) · nbytes(x)."""
    group = _check_group(exchange.group, "gather_rows")
    p, r = int(group.nranks), int(group.rank)
    if not 0 <= root < p:
        raise ValueError(
            f"gather_rows: root {root} is outside the {p} ranks of {group_label(group)}"
        )
    if p == 1:
        return x
    check.agree(f"gather_rows(root={root})", group, group_label(group), [x], timeout=timeout)
    with paddle.no_grad(), watch("gather_rows", group, timeout) as w:
        if r != root:
            link = exchange.link(group.ranks[root])
            w.task(dist.send(x.contiguous(), dst=group.ranks[root], group=link))
            out, sent, received = None, nbytes(x), 0
        else:
            parts = []
            for i in range(p):
                if i == r:
                    parts.append(x)
                    continue
                buf = paddle.empty(list(x.shape), dtype=x.dtype)
                w.task(dist.recv(buf, src=group.ranks[i], group=exchange.link(group.ranks[i])))
                parts.append(buf)
            out = paddle.concat(parts, axis=0)
            sent, received = 0, (p - 1) * nbytes(x)
    _record("gather", group, sent, received)
    return out
