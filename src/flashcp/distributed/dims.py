"""`ParallelDims`: the dp × pp × cp layout of a job's ranks, as pure arithmetic.

Nothing here talks to other processes, so every rule (validation, rank layout, which ranks
share a group) is unit-testable on one CPU. `flashcp.distributed.groups.build_groups` turns the
rank lists into real process groups.

Rank layout (row-major, outermost first)::

    rank = (dp_index * pp + pp_index) * cp + cp_index

`cp` is innermost, so the ranks of one cp group are adjacent (on a GPU node they share the
fastest links, which the per-layer K/V exchange of context parallelism needs most); `pp` comes
next and `dp` is outermost (its gradient all-reduce runs once per step).
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

    def __post_init__(self) -> None:
        for dim in DIM_ORDER:
            _check_degree(dim, getattr(self, dim))
        _check_degree("world_size", self.world_size)
        product = prod(self.degree(dim) for dim in DIM_ORDER)
        if product != self.world_size:
            raise ValueError(self._mismatch_message(product))

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
        order as the unsharded all-reduce over cp, then dp (`flashcp.trainer.zero`).
        """
        c = self.coords(rank)
        return c["cp"] * self.dp + c["dp"]

    def optimizer_shard_ranks(self, rank: int) -> list[int]:
        """The ranks sharing `rank`'s parameters (its stage's dp × cp ranks), listed by shard
        index."""
        stage = self.coords(rank)["pp"]
        return [self.rank_at(dp=i, pp=stage, cp=j) for j in range(self.cp) for i in range(self.dp)]

    def describe(self) -> str:
        """One line, e.g. `dp=1 pp=2 cp=2 (world 4, cp innermost)`."""
        body = " ".join(f"{dim}={self.degree(dim)}" for dim in DIM_ORDER)
        return f"{body} (world {self.world_size}, {DIM_ORDER[-1]} innermost)"
