"""Expert parallelism: each rank of an ep group holds E/ep of a layer's routed experts and the
tokens travel to them (all-to-all), in the Megatron-Core / DeepSeek-V3 arrangement.

Placement: ep rank `r` holds experts ``[r·E/ep, (r+1)·E/ep)`` of every MoE layer
(`expert_range`; the ep groups are carved from the dp × cp ranks of a pipeline stage,
`flashcp.distributed.ParallelDims`). A pipeline stage is built with only those experts
(`flashcp.models.StageSpec.ep_rank` / `ep_size`): `GroupedExperts.first_expert` offsets their
names, and their initial values are keyed per expert (`flashcp.models.init`), so the experts a
rank holds equal the same experts of an ep = 1 model bitwise. The router, shared experts and
everything else stay replicated.

One MoE call (`MoE.forward`, after routing and the local sort by expert,
`flashcp.models.moe_dispatch`):

1. **counts**: every rank's per-expert row counts `[E]` are all-gathered over the ep group
   (one small collective; the host needs them for the buffer shapes anyway), giving the
   `[ep, E]` matrix from which `DispatchPlan` derives every split;
2. **dispatch**: the expert-sorted buffer is already grouped by destination rank (experts of a
   rank are contiguous), so one all-to-all sends block r to rank r (`_AllToAll`, over
   `flashcp.distributed.all_to_all`: NCCL's alltoall, ordered send/recv pairs on gloo);
3. **local experts**: the received rows (source-major: all of rank 0's rows, expert by expert,
   then rank 1's, ...) enter the local experts' layout in one scatter
   (`ExpertLayout.enter(x, order)` with `DispatchPlan.expert_major`) and run through the
   grouped compute (`GroupedExperts`), then leave it in the received order;
4. **combine**: the reverse all-to-all brings every row back to the rank and position it came
   from; `moe_dispatch.combine` weights and sums as without ep.

Autograd: the backward of an all-to-all is the all-to-all with the two split lists swapped
(`_AllToAll`), so the input gradients return to the tokens' ranks and each expert's weight
gradient is computed where the expert lives, from every row it processed. Summed over the
ranks holding the same expert (`edp`, done by the trainer), it is the ep = 1 gradient up to
float32 summation order.

Bytes per rank and MoE call (`DispatchPlan.bytes_sent`; measured at the transfer by the
`all_to_all` counters): dispatch sends the rows routed to other ranks' experts, ``Σ_{r≠me}
send_splits[r]`` rows of `hidden · itemsize` bytes, and combine sends as many back; with a
uniform router that is ``T·k·(ep-1)/ep`` rows each way (T local tokens, k experts per token).
The rows travel in the experts' compute dtype (`GroupedExperts.row_dtype`): 2 bytes per value
for bf16 weights on the GPU grouped GEMM, both ways, gradients too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer
from paddle.nn import Layer

from flashcp.distributed import Exchange, all_gather_tensor, all_to_all


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The routed experts ep rank `ep_rank` of `ep_size` holds (global indices)."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep rank {ep_rank} is outside 0..{ep_size - 1}")
    if num_experts % ep_size:
        raise ValueError(
            f"model.num_experts={num_experts} is not divisible by parallel.ep={ep_size}: every "
            "ep rank holds the same number of experts"
        )
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


@dataclass(frozen=True)
class DispatchPlan:
    """Who sends how many rows to whom in one MoE call, from the `[ep, E]` count matrix
    (row s: rank s's rows per GLOBAL expert, after capacity). Pure numpy."""

    counts: np.ndarray
    """`[ep, E]` int64 rows per (source rank, expert)."""
    rank: int
    """This rank's place in the ep group."""

    def __post_init__(self) -> None:
        ep, experts = self.counts.shape
        if experts % ep:
            raise ValueError(f"{experts} experts do not split over {ep} ep ranks")
        if not 0 <= self.rank < ep:
            raise ValueError(f"ep rank {self.rank} is outside 0..{ep - 1}")

    @property
    def ep(self) -> int:
        return int(self.counts.shape[0])

    @property
    def per_rank(self) -> int:
        """Experts each rank holds."""
        return int(self.counts.shape[1]) // self.ep

    def _block(self) -> np.ndarray:
        """`[ep(source), ep(owner), per]`: rows of source s for owner r's local expert e."""
        return self.counts.reshape(self.ep, self.ep, self.per_rank)

    @property
    def send_splits(self) -> list[int]:
        """Rows this rank sends to each rank (its expert-sorted buffer, cut by owner)."""
        return [int(n) for n in self._block()[self.rank].sum(axis=1)]

    @property
    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each rank (for its own experts)."""
        return [int(n) for n in self._block()[:, self.rank].sum(axis=1)]

    @property
    def local_counts(self) -> list[int]:
        """Rows per local expert, summed over the sources."""
        return [int(n) for n in self._block()[:, self.rank].sum(axis=0)]

    @property
    def expert_major(self) -> np.ndarray:
        """`[R]` int64: for each received row (source-major: source s's rows of local expert
        0, 1, ..., then source s + 1's), its row in the expert-major buffer (expert e's rows
        from source 0, then source 1, ...), the order the local experts compute in."""
        mine = self._block()[:, self.rank]  # [source, local expert]
        starts = np.concatenate([[0], np.cumsum(mine.T.reshape(-1))[:-1]]).reshape(mine.T.shape)
        out = [
            starts[e, s] + np.arange(mine[s, e])
            for s in range(self.ep)
            for e in range(self.per_rank)
        ]
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def bytes_sent(self, row_bytes: int) -> int:
        """Payload bytes this rank sends in ONE all-to-all (dispatch; combine sends the same
        number back): its rows for other ranks' experts."""
        send = self.send_splits
        return row_bytes * sum(n for r, n in enumerate(send) if r != self.rank)

    def bytes_received(self, row_bytes: int) -> int:
        """Payload bytes this rank receives in one all-to-all."""
        recv = self.recv_splits
        return row_bytes * sum(n for r, n in enumerate(recv) if r != self.rank)


def uniform_bytes_per_rank(tokens: int, top_k: int, hidden: int, item: int, ep: int) -> float:
    """Theory: bytes one rank sends per all-to-all when routing is uniform over the experts —
    its `tokens · top_k` rows, the fraction `(ep - 1) / ep` of them for other ranks."""
    return tokens * top_k * hidden * item * (ep - 1) / ep


def exchange_counts(counts: Sequence[int], exchange: Exchange) -> np.ndarray:
    """Every ep rank's per-expert counts, `[ep, E]` (an all-gather over the ep group)."""
    local = paddle.to_tensor(np.asarray(counts, dtype=np.int64))
    gathered = all_gather_tensor(local, exchange.group, axis=0)
    return gathered.numpy().reshape(exchange.nranks, len(counts))


class _AllToAll(PyLayer):
    """`all_to_all` forward; backward sends the gradients back (split lists swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, exchange):  # type: ignore[no-untyped-def, override]
        ctx.send, ctx.recv, ctx.exchange = list(send), list(recv), exchange
        return all_to_all(x, send, recv, exchange)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return all_to_all(grad, ctx.recv, ctx.send, ctx.exchange)


def exchange_rows(
    x: paddle.Tensor, send: Sequence[int], recv: Sequence[int], exchange: Exchange
) -> paddle.Tensor:
    """The all-to-all of `x`'s row blocks, differentiable (module docstring, steps 2 and 4)."""
    return _AllToAll.apply(x, list(send), list(recv), exchange)


def expert_parallel_rows(
    experts: Layer, rows: paddle.Tensor, counts: Sequence[int], exchange: Exchange
) -> tuple[paddle.Tensor, DispatchPlan]:
    """The routed experts' outputs for `rows` (this rank's expert-sorted buffer, `counts[e]`
    rows per GLOBAL expert), computed on the ranks holding the experts; same shape and row
    order as `rows`. Returns them and the call's `DispatchPlan`."""
    plan = DispatchPlan(exchange_counts(counts, exchange), exchange.rank)
    received = exchange_rows(rows, plan.send_splits, plan.recv_splits, exchange)
    layout = experts.plan(plan.local_counts, received)
    order = plan.expert_major
    out = layout.leave(experts(layout.enter(received, order), layout), order)
    return exchange_rows(out, plan.recv_splits, plan.send_splits, exchange), plan


@dataclass(frozen=True)
class ExpertSlice:
    """The experts a rank holds of one stacked tensor: rows `[first, first + count)` of the
    full `[total, ...]` tensor (its leading axis is the expert)."""

    first: int
    count: int
    total: int

    @property
    def partial(self) -> bool:
        return self.count != self.total


def expert_tensors(module: Layer) -> dict[str, ExpertSlice]:
    """Structured name → `ExpertSlice` of every parameter (adapters included) of every
    stacked-experts layer of `module` (`GroupedExperts`, its LoRA wrapper) that holds only
    some of its layer's experts; empty without expert parallelism."""
    out: dict[str, ExpertSlice] = {}
    for name, layer in module.named_sublayers():
        total = getattr(layer, "total_experts", None)
        if not getattr(layer, "STACKED_EXPERTS", False) or total is None:
            continue
        piece = ExpertSlice(int(layer.first_expert), int(layer.num_experts), int(total))
        if not piece.partial:
            continue
        for pname, _ in layer.named_parameters(prefix=name, include_sublayers=False):
            out[pname] = piece
    return out


def attach_exchange(module: Layer, exchange: Any) -> int:
    """Give every expert-parallel MoE layer of `module` the ep group it exchanges tokens on
    (an `flashcp.distributed.Exchange`, e.g. `ParallelGroups.ep_exchange()`); returns how many.
    Raises when the group's size or this rank's place in it do not match the experts built."""
    count = 0
    for name, layer in module.named_sublayers(include_self=True):
        ep_size = getattr(layer, "ep_size", None)
        if ep_size is None or getattr(layer, "ep_rank", None) is None:
            continue
        if ep_size == 1:
            continue
        if exchange.nranks != ep_size or exchange.rank != layer.ep_rank:
            raise ValueError(
                f"{name} holds the experts of ep rank {layer.ep_rank} of {ep_size}, but the ep "
                f"group {exchange.label} has {exchange.nranks} ranks and this rank is its "
                f"{exchange.rank}: build the stage with the job's parallel.ep"
            )
        layer.exchange = exchange
        count += 1
    return count
