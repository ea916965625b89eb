"""The NCCL communicators a rank of a GPU job creates, and the device memory planned for them.

Paddle's NCCL process group (`ProcessGroupNCCL`) creates one communicator per process group, at
its first collective (`paddle.distributed.new_group` initialises lazily in dynamic mode,
`nccl_comm_init_option` 0), and for every send / recv that is not batched one MORE, two-rank
communicator per pair of peers (`ProcessGroupNCCL::Point2Point`: key ``"low->high"``, its own
unique id, `IsP2POP`). Each communicator allocates its own buffers on the device.

What flashcp creates (`flashcp.distributed.groups.build_groups`, `flashcp.distributed.p2p`,
`flashcp.distributed.alltoall`):

* groups: the world (barriers, object gathers, metrics), and each dp / pp / cp / ep / edp group
  of more than one rank that is not the whole world (one spanning the world reuses it);
  the all-to-all of expert parallelism runs inside the ep group's own communicator;
* p2p pairs: the pipeline's neighbour stages (send / recv on the pp group), the first and the
  last stage of a tied embedding (pp > 2; with pp = 2 that is the neighbour pair), and the
  expert gathers of checkpoints and exports (`gather_rows` on the ep group: the first rank of a
  stage receives from every other rank of its ep group, which send to it).

The size per communicator is a stated planning figure, `NCCL_COMMUNICATOR_BYTES`: NVIDIA's
figures for one communicator on an 8-GPU NVLink node range 0.5–1.6 GB (channels × peers ×
protocol buffers, more with NVLink SHARP on Hopper); the plan takes 1 GiB for each, pairs
included (NCCL releases before 2.22 connect every algorithm's buffers at creation). Not
measured here: no GPU. `GPU_FIXED_BYTES` (`flashcp.plan.model`) keeps the rest of the non-tensor
memory (CUDA context, cuBLAS / cuDNN workspaces), so a job with one communicator plans what it
did before communicators were counted (2 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashcp.config.schema import Config
from flashcp.distributed.dims import GROUP_KINDS, ParallelDims, kind_groups

GIB = 2**30
NCCL_COMMUNICATOR_BYTES = 1 * GIB
"""Device memory planned per NCCL communicator (module docstring)."""


@dataclass(frozen=True)
class Communicators:
    """The NCCL communicators of one rank: its groups (by kind) and its p2p pairs (peers)."""

    groups: tuple[str, ...]
    """`world`, `pp`, `cp`, ... — one communicator each."""
    pairs: tuple[tuple[str, int], ...]
    """(what, peer global rank) — one two-rank communicator each."""

    @property
    def count(self) -> int:
        return len(self.groups) + len(self.pairs)

    @property
    def bytes(self) -> int:
        return self.count * NCCL_COMMUNICATOR_BYTES

    def describe(self) -> str:
        """E.g. ``4 NCCL communicators (groups world, pp, cp; p2p pp 1)``."""
        parts = [f"groups {', '.join(self.groups)}"] if self.groups else []
        if self.pairs:
            kinds: dict[str, int] = {}
            for what, _ in self.pairs:
                kinds[what] = kinds.get(what, 0) + 1
            parts.append("p2p " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
        body = f" ({'; '.join(parts)})" if parts else ""
        return f"{self.count} NCCL communicator{'s' if self.count != 1 else ''}{body}"


def job_dims(cfg: Config) -> ParallelDims:
    """The job's rank layout."""
    p = cfg.parallel
    return ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=p.world_size, ep=p.ep)


def communicators(cfg: Config, rank: int) -> Communicators:
    """The NCCL communicators global rank `rank` of `cfg`'s job creates (module docstring)."""
    dims = job_dims(cfg)
    world = dims.world_size
    if world == 1:
        return Communicators((), ())
    groups = ["world"]
    for kind in GROUP_KINDS:
        for ranks in kind_groups(dims, kind):
            if rank in ranks and len(ranks) < world:
                groups.append(kind)
    pairs: list[tuple[str, int]] = []
    pp = dims.pp
    if pp > 1:
        stage_ranks = dims.group_ranks("pp", rank)
        s = stage_ranks.index(rank)
        if s > 0:
            pairs.append(("pp", stage_ranks[s - 1]))
        if s < pp - 1:
            pairs.append(("pp", stage_ranks[s + 1]))
        if cfg.model.tie_embeddings and pp > 2 and s in (0, pp - 1):
            pairs.append(("tied", stage_ranks[-1] if s == 0 else stage_ranks[0]))
    if dims.ep > 1 and dims.stage_index(rank) < dims.ep:  # the stage writer's ep group
        ep_ranks = dims.ep_group_ranks(rank)
        root = ep_ranks[0]
        peers = ep_ranks[1:] if rank == root else [root]
        pairs += [("ep gather", peer) for peer in peers]
    return Communicators(tuple(groups), tuple(pairs))
