"""The host-memory plan: what each rank keeps in host (CPU) memory, summed per node.

Device memory is planned per rank (`flashcp.plan.model`); host memory is shared by the ranks of
a node, so its budget (`hardware.host_memory_gib`) is per node, of which
`hardware.host_memory_reserve` (a fraction) is left to the operating system, its page cache and
what the plan does not count. A rank's host memory peaks at
one of two moments:

* ``training step``: the activations an offload moved out (`flashcp.plan.features`,
  `flashcp.models.offload`: every in-flight micro-batch's layer inputs, in the residual dtype,
  and under refined recompute the stored attention outputs and LSEs) — all of them at once
  when the last forward of the step has run and its backward has not fetched anything back
  yet. On a GPU each copy is its own pinned buffer (`Tensor.pin_memory`), freed when it is
  back on the device: the offloaded bytes are the pinned bytes, no staging besides;
* ``checkpoint save`` (when the run saves, `CheckpointConfig.saves`): the numpy copies a
  checkpoint is written from (`flashcp.checkpoint.saving`: one file at a time, the stage's
  model part by its writer, then this rank's optimizer part; safetensors writes from them
  without another copy). With `checkpoint.async` the copies of every file are taken at once
  and held while training goes on (pinned on a GPU), so they are counted in the ``training
  step`` moment instead: model part plus optimizer part.

Both moments add the rank's own process memory (`HOST_PROCESS_BYTES` on a GPU node: Python,
Paddle's and CUDA's libraries and host-side state, the data pipeline). On CPU the device plan is
itself host memory and counts Paddle's tensors only; the host plan then lists what lives
outside Paddle's allocator — the offload's numpy copies — and no process estimate.

A node holds ranks ``[k·n, (k+1)·n)`` (n = ranks per node: `hardware.gpus_per_node`, or the
launch's dp·pp·cp / --nnodes); its plan is, per moment, the sum of its ranks' items (the ranks
step together), and its peak the largest moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashcp.plan.params import stage_parameters
from flashcp.plan.setup import Setup, numel
from flashcp.plan.state import StageState

GIB = 2**30

HOST_ITEMS: tuple[str, ...] = (
    "offloaded_activations",
    "checkpoint_arrays",
    "host_process",
)
"""Every item of a rank's host plan."""

HOST_ITEM_DOCS: dict[str, str] = {
    "offloaded_activations": "activation offload: the layer inputs (stage inputs, refined "
    "attention outputs and LSEs) of the in-flight micro-batches, in the residual dtype (on GPU "
    "pinned memory)",
    "checkpoint_arrays": "numpy copies of this rank's model part or optimizer shard while a "
    "checkpoint is written (checkpoint.every > 0 or checkpoint.save_last); with "
    "checkpoint.async both, held while training goes on (on GPU pinned memory)",
    "host_process": "the rank's process besides those: Python, Paddle's and CUDA's libraries "
    "and host-side state, the data pipeline (GPU estimate; 0 on CPU)",
}

HOST_PROCESS_BYTES = 8 * GIB
"""Host memory of one GPU rank's process besides the planned arrays — an allowance, not a
measurement: a Paddle GPU process maps a few GiB of CUDA, cuDNN, cuBLAS and NCCL libraries and
its own, and holds the tokenised data and Python's objects."""


@dataclass(frozen=True)
class StageHost:
    """What one stage's ranks put in host memory, from the stage's device plan."""

    offloaded: float
    """Bytes one micro-batch moves to host (0 without offload)."""
    flight: int
    """Micro-batches in flight on the stage (their stashes coexist)."""
    model_part: int
    """Bytes of the stage's model arrays its checkpoint writer copies out."""
    optimizer_part: int
    """Bytes of the optimizer arrays one rank of the stage copies out (its shard)."""
    writer_optimizer_part: int
    """The same for the stage's writer (unsharded optimizer state is written by it alone)."""


@dataclass
class HostRank:
    """One rank's host plan: every moment's items; `items` is the largest moment's."""

    rank: int
    stage: int
    moments: dict[str, dict[str, int]]
    checkpoint_bytes: int = 0
    """Bytes this rank writes per checkpoint (its stage's model part if it is the stage's
    writer, and its optimizer part): what a pre-emption save must fit in its grace period."""

    @property
    def moment(self) -> str:
        return max(self.moments, key=lambda m: (sum(self.moments[m].values()), m))

    @property
    def items(self) -> dict[str, int]:
        return dict(self.moments[self.moment])

    @property
    def total_bytes(self) -> int:
        return int(sum(self.items.values()))


@dataclass(frozen=True)
class NodeHost:
    """One node's host plan: its ranks, and per item the sum over them at its peak moment."""

    node: int
    ranks: list[int]
    moment: str
    items: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return int(sum(self.items.values()))

    def largest_item(self) -> tuple[str, int]:
        name = max(self.items, key=lambda k: self.items[k])
        return name, self.items[name]


def usable(budget: int | None, margin: float) -> int | None:
    """A budget less the fraction `margin` of it kept free (None: no budget)."""
    return None if budget is None else int(budget * (1.0 - margin))


@dataclass
class HostPlan:
    """Every rank's host plan, its nodes and the per-node budget, of which `reserve` (a
    fraction, `hardware.host_memory_reserve`) is left to the operating system."""

    ranks: list[HostRank]
    ranks_per_node: int
    budget_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    reserve: float = 0.0

    @property
    def usable_bytes(self) -> int | None:
        """What the nodes' ranks may fill: the budget less its reserve (None: no budget)."""
        return usable(self.budget_bytes, self.reserve)

    def nodes(self) -> list[NodeHost]:
        """Each node's plan: per moment the sum of its ranks' items, at the largest moment."""
        out = []
        n = max(1, self.ranks_per_node)
        for start in range(0, len(self.ranks), n):
            group = self.ranks[start : start + n]
            names = sorted({m for r in group for m in r.moments})
            sums = {}
            for name in names:
                sums[name] = {k: sum(r.moments.get(name, {}).get(k, 0) for r in group)
                              for k in HOST_ITEMS}  # fmt: skip
            peak = max(sums, key=lambda m: (sum(sums[m].values()), m))
            out.append(NodeHost(start // n, [r.rank for r in group], peak, sums[peak]))
        return out

    @property
    def peak(self) -> NodeHost:
        return max(self.nodes(), key=lambda x: (x.total_bytes, -x.node))

    @property
    def fits(self) -> bool:
        """Every node within the usable budget (or no budget)."""
        use = self.usable_bytes
        return use is None or all(x.total_bytes <= use for x in self.nodes())

    def to_json(self) -> dict[str, Any]:
        """`{"budget_bytes", "reserve", "usable_budget_bytes", "ranks_per_node", "fits",
        "nodes": [...], "ranks": [...]}`."""
        return {
            "budget_bytes": self.budget_bytes,
            "reserve": self.reserve,
            "usable_budget_bytes": self.usable_bytes,
            "ranks_per_node": self.ranks_per_node,
            "fits": self.fits,
            "nodes": [
                {"node": x.node, "ranks": x.ranks, "moment": x.moment,
                 "total_bytes": x.total_bytes, "items": x.items}
                for x in self.nodes()
            ],  # fmt: skip
            "ranks": [
                {"rank": r.rank, "stage": r.stage, "moment": r.moment,
                 "total_bytes": r.total_bytes, "items": r.items,
                 "checkpoint_bytes": r.checkpoint_bytes}
                for r in self.ranks
            ],  # fmt: skip
        }


def written_bytes(stage: StageHost, *, writer: bool) -> int:
    """Bytes one rank writes per checkpoint: the stage writer its model part and optimizer
    part (or whole unsharded state), another rank its optimizer shard, if any."""
    if writer:
        return int(stage.model_part + stage.writer_optimizer_part)
    return int(stage.optimizer_part)


def rank_moments(
    stage: StageHost,
    *,
    writer: bool,
    gpu: bool,
    checkpoints: bool,
    async_checkpoints: bool = False,
) -> dict[str, dict[str, int]]:
    """One rank's host moments (see the module docstring). `writer`: the rank writes its
    stage's model part; `checkpoints`: the run saves checkpoints; `async_checkpoints`: in the
    background, from copies held during the training step (`checkpoint.async`)."""
    process = HOST_PROCESS_BYTES if gpu else 0

    def items(**values: float) -> dict[str, int]:
        out = dict.fromkeys(HOST_ITEMS, 0)
        out.update({k: int(v) for k, v in values.items()})
        return out

    optimizer = stage.writer_optimizer_part if writer else stage.optimizer_part
    model = stage.model_part if writer else 0
    held = model + optimizer if checkpoints and async_checkpoints else 0
    moments = {
        "training step": items(
            offloaded_activations=stage.flight * stage.offloaded,
            checkpoint_arrays=held,
            host_process=process,
        )
    }
    if checkpoints and not async_checkpoints:
        moments["checkpoint save"] = items(
            checkpoint_arrays=max(model, optimizer), host_process=process
        )
    return moments


def stage_host(s: Setup, state: StageState, offloaded: float, flight: int) -> StageHost:
    """What `state`'s stage puts in host memory: `offloaded` bytes per micro-batch
    (activation offload) for `flight` micro-batches, and the checkpoint's numpy copies — the
    stage's model part (LoRA: the adapters alone; else every parameter and persistent buffer,
    the experts of the writer's ep group gathered whole) and its float32 masters and both
    moments (one shard per rank under ZeRO-1, or the stage writer's whole copy; Paddle's
    AdamW, no masters: its moments, by the writer)."""
    whole = stage_parameters(
        s.args, state.stage, s.pp, s.pp_layers, lora_targets=s.lora_targets,
        lora_rank=s.lora_rank,
    )  # fmt: skip
    PT = state.trained_bytes
    if s.lora_targets is not None:  # the adapters alone
        model_part = numel(whole, True) * PT
    else:  # every parameter and persistent buffer
        model_part = (numel(whole, True) * PT + numel(whole, False) * state.dt.param
                      + state.items["buffers"])  # fmt: skip
    shard_part = state.n_state * (4 + 8)
    return StageHost(
        offloaded=float(offloaded),
        flight=flight,
        model_part=model_part,
        optimizer_part=shard_part if state.master and s.shard else 0,
        writer_optimizer_part=shard_part if state.master else 8 * state.n_trained,
    )
