"""`ParallelDims`: the dp × pp × cp layout of a job's ranks, as pure arithmetic.

Nothing here talks to other processes, so every rule (validation, rank layout, which ranks
share a group) is unit-testable on one CPU. `flashcp.distributed.groups.build_groups` turns the
rank lists into real process groups.

Rank layout (row-major, outermost first)::

    rank = (dp_index * pp + pp_index) * cp + cp_index

`cp` is innermost, so the ranks of one cp group are adjacent (on a GPU node they share the
fastest links, which the per-layer K/V exchange of context parallelism needs most); `pp` comes
next and `dp` is outermost (its gradient all-reduce runs once per step).

Expert parallelism (`ep`, MoE models) is not a mesh dimension of its own: as in Megatron-Core
and DeepSeek-V3, the expert-parallel groups are carved from the dp × cp ranks of one pipeline
stage. Inside a stage the ranks are numbered by their stage index ``j = dp_index · cp +
cp_index`` (their global rank order); the ep group of rank `j` is the `ep` consecutive indices
``j - j % ep .. j - j % ep + ep - 1`` (so with ep <= cp it lies inside one cp group, on the
fastest links), its place in it is ``j % ep`` (it holds experts ``[(j % ep)·E/ep,
(j % ep + 1)·E/ep)``), and the ranks holding the SAME experts — the ``edp`` ("expert data
parallel") group, over which expert gradients are summed — are the ``dp·cp/ep`` indices with
equal ``j % ep``. Rule: ep divides dp × cp (and the number of routed experts; see
`flashcp.config.schema.ParallelConfig.ep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

DIM_ORDER: tuple[str, ...] = ("dp", "pp", "cp")
"""Mesh dimensions, outermost first; the last one varies fastest with the rank."""

WORLD = "world"
CONFIG_KEYS: dict[str, str] = {dim: f"parallel.{dim}" for dim in DIM_ORDER}


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be an integer >= 1, got {value!r}"
            + (f" (config key `{CONFIG_KEYS[name]}`)" if name in CONFIG_KEYS else "")
        )
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, pipeline and context parallelism for a job of `world_size` ranks.

    Raises `ValueError` at construction when a degree is not a positive int or when
    dp × pp × cp differs from `world_size`; the message shows each factor and which config key
    or launch flag would fix it.
    """

    dp: int
    pp: int
    cp: int
    world_size: int
    ep: int = 1
    """Expert-parallel degree (see the module docstring); 1 = every rank holds every expert."""

    def __post_init__(self) -> None:
        for dim in DIM_ORDER:
            _check_degree(dim, getattr(self, dim))
        _check_degree("world_size", self.world_size)
        product = prod(self.degree(dim) for dim in DIM_ORDER)
        if product != self.world_size:
            raise ValueError(self._mismatch_message(product))
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(
                f"ep must be an integer >= 1, got {self.ep!r} (config key `parallel.ep`)"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(ep_divides_message(self.ep, self.dp, self.cp))

    def _mismatch_message(self, product: int) -> str:
        factors = " × ".join(f"{dim}({self.degree(dim)})" for dim in DIM_ORDER)
        fixes = []
        for dim in reversed(DIM_ORDER):  # suggest the innermost dimension first
            others = prod(self.degree(d) for d in DIM_ORDER if d != dim)
            if self.world_size % others == 0:
                fixes.append(f"set {CONFIG_KEYS[dim]} to {self.world_size // others}")
        keys = ", ".join(CONFIG_KEYS[d] for d in DIM_ORDER)
        change = " or ".join(fixes) if fixes else f"change {keys} so their product is"
        if not fixes:
            change += f" {self.world_size}"
        process_word = "process" if self.world_size == 1 else "processes"
        return (
            f"{factors} = {product} but the job has {self.world_size} {process_word}: "
            f"{change}, or launch with --nproc_per_node {product}"
        )

    # -- sizes -------------------------------------------------------------------------------

    @property
    def degrees(self) -> dict[str, int]:
        """`{"dp": dp, "pp": pp, "cp": cp}` in layout order."""
        return {dim: self.degree(dim) for dim in DIM_ORDER}

    def degree(self, dim: str) -> int:
        """Size of dimension `dim` ("dp", "pp", "cp" or "world")."""
        if dim == WORLD:
            return self.world_size
        if dim not in DIM_ORDER:
            raise KeyError(f"unknown parallel dimension {dim!r}: use one of {DIM_ORDER + (WORLD,)}")
        return int(getattr(self, dim))

    size = degree

    def enabled(self, dim: str) -> bool:
        """Whether `dim` actually splits work (degree > 1)."""
        return self.degree(dim) > 1

    @property
    def enabled_dims(self) -> tuple[str, ...]:
        """Dimensions with degree > 1, in layout order."""
        return tuple(dim for dim in DIM_ORDER if self.enabled(dim))

    def _stride(self, dim: str) -> int:
        index = DIM_ORDER.index(dim)
        return prod(self.degree(d) for d in DIM_ORDER[index + 1 :])

    # -- coordinates -------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside the job's ranks 0..{self.world_size - 1}")
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` along each dimension, e.g. `{"dp": 0, "pp": 1, "cp": 0}`."""
        self._check_rank(rank)
        return {dim: (rank // self._stride(dim)) % self.degree(dim) for dim in DIM_ORDER}

    def rank_in(self, dim: str, rank: int) -> int:
        """Index of `rank` inside its `dim` group (= its rank in that process group)."""
        if dim == WORLD:
            return self._check_rank(rank)
        return self.coords(rank)[dim]

    def rank_at(self, dp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """Global rank of the coordinate (dp, pp, cp)."""
        coord = {"dp": dp, "pp": pp, "cp": cp}
        for dim, value in coord.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{dim} index must be an int, got {value!r}")
            if not 0 <= value < self.degree(dim):
                raise ValueError(f"{dim} index {value} is outside 0..{self.degree(dim) - 1}")
        return sum(coord[dim] * self._stride(dim) for dim in DIM_ORDER)

    # -- groups ------------------------------------------------------------------------------

    def groups_for(self, dim: str) -> list[list[int]]:
        """All rank lists of `dim`, each sorted, ordered by their lowest rank.

        Every rank appears in exactly one list; the i-th entry of a list is the rank whose
        `rank_in(dim, ...)` is i. `"world"` gives the single list of all ranks.
        """
        if dim == WORLD:
            return [list(range(self.world_size))]
        self.degree(dim)  # validates the name
        stride = self._stride(dim)
        span = stride * self.degree(dim)
        groups = []
        for base in range(self.world_size):
            if (base // stride) % self.degree(dim) == 0:
                groups.append(list(range(base, base + span, stride)))
        return groups

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks sharing `rank`'s `dim` group (including `rank`)."""
        self._check_rank(rank)
        for ranks in self.groups_for(dim):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: every rank is in one group")

    # -- optimizer shards (ZeRO-1) ------------------------------------------------------------

    @property
    def optimizer_shards(self) -> int:
        """dp × cp: the ranks holding the same parameters (one pipeline stage's), over which
        `parallel.shard_optimizer` splits the optimizer state."""
        return self.dp * self.cp

    def optimizer_shard_index(self, rank: int) -> int:
        """Which optimizer shard `rank` owns: `cp_index · dp + dp_index`.

        Gradients are reduce-scattered over the cp group first (rank j of it keeps chunk j),
        then over the dp group (rank i keeps sub-chunk i of that), so the sums run in the same
        order as the unsharded all-reduce over cp, then dp (`flashcp.optim.master_optimizer`).
        """
        c = self.coords(rank)
        return c["cp"] * self.dp + c["dp"]

    def optimizer_shard_ranks(self, rank: int) -> list[int]:
        """The ranks sharing `rank`'s parameters (its stage's dp × cp ranks), listed by shard
        index."""
        stage = self.coords(rank)["pp"]
        return [self.rank_at(dp=i, pp=stage, cp=j) for j in range(self.cp) for i in range(self.dp)]

    # -- expert parallelism -------------------------------------------------------------------

    def stage_index(self, rank: int) -> int:
        """`rank`'s index among the dp × cp ranks of its pipeline stage: dp_index · cp + cp_index
        (the stage's ranks in global rank order)."""
        c = self.coords(rank)
        return c["dp"] * self.cp + c["cp"]

    def stage_ranks(self, stage: int) -> list[int]:
        """The dp × cp ranks of pipeline stage `stage`, by stage index."""
        return [self.rank_at(dp=i, pp=stage, cp=j) for i in range(self.dp) for j in range(self.cp)]

    def ep_rank(self, rank: int) -> int:
        """`rank`'s place in its ep group: which 1/ep of the routed experts it holds."""
        return self.stage_index(rank) % self.ep

    def ep_group_ranks(self, rank: int) -> list[int]:
        """The ep ranks `rank` exchanges tokens with (itself included), by ep rank."""
        j = self.stage_index(rank)
        stage = self.stage_ranks(self.coords(rank)["pp"])
        return stage[j - j % self.ep : j - j % self.ep + self.ep]

    def edp_group_ranks(self, rank: int) -> list[int]:
        """The ranks of `rank`'s stage holding the same experts (itself included): expert
        gradients are summed over these dp·cp/ep ranks only."""
        j = self.stage_index(rank)
        stage = self.stage_ranks(self.coords(rank)["pp"])
        return stage[j % self.ep :: self.ep]

    def expert_groups_for(self, kind: str) -> list[list[int]]:
        """All `ep` or `edp` rank lists of the job, ordered by their lowest rank."""
        if kind not in ("ep", "edp"):
            raise KeyError(f"unknown expert group kind {kind!r}: use 'ep' or 'edp'")
        of = self.ep_group_ranks if kind == "ep" else self.edp_group_ranks
        found: list[list[int]] = []
        for rank in range(self.world_size):
            ranks = of(rank)
            if ranks not in found:
                found.append(ranks)
        return sorted(found)

    def describe(self) -> str:
        """One line, e.g. `dp=1 pp=2 cp=2 (world 4, cp innermost)` (`ep=2` added when > 1)."""
        body = " ".join(f"{dim}={self.degree(dim)}" for dim in DIM_ORDER)
        if self.ep > 1:
            body += f" ep={self.ep}"
        return f"{body} (world {self.world_size}, {DIM_ORDER[-1]} innermost)"


def ep_divides_message(ep: int, dp: int, cp: int) -> str:
    """The message when `parallel.ep` does not divide the dp × cp ranks of a stage."""
    fits = [d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]
    return (
        f"parallel.ep={ep} does not divide dp×cp={dp * cp} (parallel.dp={dp}, parallel.cp={cp}): "
        f"the expert-parallel groups are carved from the dp × cp ranks of a pipeline stage; "
        f"set parallel.ep to one of {fits}"
    )


GROUP_KINDS: tuple[str, ...] = (*DIM_ORDER, "ep", "edp")
"""Every kind of group `build_groups` makes, in creation order (mesh dimensions, then the
expert-parallel groups)."""


def kind_groups(dims: ParallelDims, kind: str) -> list[list[int]]:
    """Every rank list of group kind `kind` (a mesh dimension, `ep` or `edp`); none for a
    trivial kind (one rank per group)."""
    if kind in DIM_ORDER:
        return dims.groups_for(kind) if dims.enabled(kind) else []
    if dims.ep == 1:
        return []
    groups = dims.expert_groups_for(kind)
    return [] if len(groups[0]) == 1 else groups
