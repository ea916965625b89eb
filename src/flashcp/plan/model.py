"""The memory plan of a run: bytes per rank at the moment of its peak, item by item.

A rank's memory is the *persistent* state (parameters, gradients, float32 master weights and
Adam moments, the DPO reference copy) plus what one moment of the step adds. The planner
evaluates the moments where a rank can peak and keeps the largest:

* ``forward: loss`` (last stage): every in-flight micro-batch's saved activations plus the
  logits and the loss's softmax (or one chunk's, `train.loss_chunk_tokens`);
* ``backward: head`` (last stage): the same, the softmax turned gradient, the head's weight
  gradient being formed;
* ``backward: layer``: for each layer of the stage, two moments of its backward — its MLP
  (the whole layer still kept) and its attention (only the attention's inputs kept, plus the
  FlashMask backward and under CP the full-sequence K/V) — with the layers below it kept and
  under recompute the layer's re-run forward; the worst one counts;
* ``backward: embedding`` (first stage): the embedding's dense gradient being formed;
* ``reference forward`` (DPO): the no-gradient reference pass;
* trained multi-token-prediction layers (`model.mtp_layers`, `model.mtp_loss_weight` > 0; the
  last stage): ``forward: mtp loss`` and ``backward: mtp head`` (a depth's head, every depth's
  activations kept), ``backward: mtp layer`` (a depth's block backward above the stage's kept
  layers, planned like one more layer), ``backward: mtp embedding``, and under recompute
  ``forward: mtp layer``; the MTP branch back-propagates before the stage's layers, so their
  moments hold none of it. Frozen MTP layers are weights only (item ``mtp_params``);
* ``optimizer step``: gradient all-reduce buckets, the squared-norm temporaries, the pipeline
  clip's gradient copy; with float32 masters (bf16 storage or ZeRO) the flat reduce-scatter
  buffers, then the shard's gradients and their clipped copy and the all-gather buffers.

Each part is its own module, and this one assembles them (`stage_plan`): the persistent state
(`flashcp.plan.state`), the layers and ``backward: layer`` (`flashcp.plan.layer`), the head,
loss and embedding moments (`flashcp.plan.head`), the no-grad forwards (`flashcp.plan.forward`),
the optimizer step (`flashcp.plan.optimizer`) and host memory (`flashcp.plan.host`); the items
they report are `flashcp.plan.items`.

Micro-batches in flight on stage s: 1 with pp = 1; ``min(pp - s, grad_accum)`` under 1F1B;
``grad_accum`` under GPipe (`flashcp.pipeline.schedule`). Ranks of one stage (its dp × cp
ranks) hold equal bytes; ZeRO-1 (`parallel.shard_optimizer`) divides master weights and Adam
moments by dp × cp.

Expert parallelism (`parallel.ep`): a rank holds E/ep routed experts per MoE layer (their
gradients, masters and moments with them; under ZeRO-1 the experts' optimizer state is sharded
over the dp·cp/ep ranks of their edp group instead of dp × cp), its experts compute the rows
the ep ranks send them, and each MoE layer's all-to-all exchanges hold their buffers
(`moe_rows.ep_exchange_bytes`) while the layer runs forward or backward: between the combine, the
experts and the permute, so the layer's peak has the larger of them and the MoE backward's
working set (``ep_buffers``: the excess).

What it models is flashcp's code: each rank builds only its stage, directly in
`train.param_dtype` (bf16: float32 `main_grad` accumulation, float32 master weights; LoRA
adapters stay float32), `parallel.shard_optimizer` (`flashcp.optim.master_optimizer`), the
loss over final hidden states (`flashcp.models.head`), recompute none / full / refined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashcp.config.schema import Config
from flashcp.plan.comms import Communicators, communicators
from flashcp.plan.features import Features
from flashcp.plan.forward import forward_moments
from flashcp.plan.head import InFlight, embedding_moment, head_plan, loss_moments
from flashcp.plan.host import (
    HostPlan,
    HostRank,
    StageHost,
    rank_moments,
    stage_host,
    usable,
    written_bytes,
)
from flashcp.plan.items import GIB, GPU_FIXED_BYTES, ITEM_DOCS, ITEMS, Moments
from flashcp.plan.layer import stage_layers
from flashcp.plan.optimizer import backward_bucket_set, optimizer_moments
from flashcp.plan.setup import Setup, check_features, in_flight, setup
from flashcp.plan.state import stage_state

__all__ = ["GIB", "ITEMS", "ITEM_DOCS", "Plan", "RankPlan", "Setup", "plan", "ranks_per_node",
           "setup", "stage_plan"]


@dataclass
class RankPlan:
    """One rank's plan: `items` are the bytes live at its peak (`moment`), summing to total."""

    rank: int
    stage: int
    items: dict[str, int]
    moment: str
    moments: dict[str, dict[str, int]] = field(default_factory=dict)
    """Every evaluated moment's items (bytes); `items` is the largest one's."""
    layers: range = range(0)
    communicators: Communicators | None = None
    """The NCCL communicators behind ``nccl_communicators`` (GPU plans)."""

    @property
    def totals(self) -> dict[str, int]:
        """Every moment's total bytes."""
        return {name: int(sum(items.values())) for name, items in self.moments.items()}

    @property
    def total_bytes(self) -> int:
        return int(sum(self.items.values()))

    def largest_item(self) -> tuple[str, int]:
        name = max(self.items, key=lambda k: self.items[k])
        return name, self.items[name]


@dataclass
class Plan:
    """The plan of every rank of a job, and the device budget it is checked against: the
    device's memory (`budget_bytes`) less the `headroom` kept free (`usable_bytes`)."""

    ranks: list[RankPlan]
    budget_bytes: int | None
    device: str
    compute_dtype: str
    param_dtype: str
    notes: list[str] = field(default_factory=list)
    host: HostPlan | None = None
    """The host-memory plan (`flashcp.plan.host`), per rank and per node."""
    features: Features = Features()
    """The long-context mechanisms this plan assumed (`flashcp.plan.features`)."""
    headroom: float = 0.0
    """Fraction of the device budget kept free (`hardware.memory_headroom`)."""

    @property
    def peak(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.total_bytes, -r.rank))

    @property
    def usable_bytes(self) -> int | None:
        """What the plan may fill: the budget less its headroom (None: no budget)."""
        return usable(self.budget_bytes, self.headroom)

    @property
    def margin_bytes(self) -> int | None:
        """What the peak rank leaves of the usable budget (negative: over; None: no
        budget)."""
        use = self.usable_bytes
        return None if use is None else use - self.peak.total_bytes

    @property
    def device_fits(self) -> bool:
        """Every rank within the usable device budget (or no budget)."""
        use = self.usable_bytes
        return use is None or all(r.total_bytes <= use for r in self.ranks)

    @property
    def host_fits(self) -> bool:
        """Every node within the host budget (or no budget)."""
        return self.host is None or self.host.fits

    @property
    def fits(self) -> bool:
        """Both budgets hold."""
        return self.device_fits and self.host_fits

    def stages(self) -> list[RankPlan]:
        """The largest rank of every stage (the lowest among equals): a stage's ranks differ
        only in the NCCL communicators they create (GPU)."""
        seen: dict[int, RankPlan] = {}
        for r in self.ranks:
            if r.stage not in seen or r.total_bytes > seen[r.stage].total_bytes:
                seen[r.stage] = r
        return [seen[s] for s in sorted(seen)]

    def to_json(self) -> dict[str, Any]:
        """`{"ranks": [{"rank", "stage", "total_bytes", "items"}], "budget_bytes", "headroom",
        "usable_budget_bytes", "fits", "host": HostPlan.to_json(), "features": {non-default
        Features}}`; `fits` is both budgets' (after their margins)."""
        return {
            "ranks": [
                {
                    "rank": r.rank,
                    "stage": r.stage,
                    "total_bytes": r.total_bytes,
                    "items": dict(r.items),
                }
                for r in self.ranks
            ],
            "budget_bytes": self.budget_bytes,
            "headroom": self.headroom,
            "usable_budget_bytes": self.usable_bytes,
            "fits": self.fits,
            "host": self.host.to_json() if self.host is not None else None,
            "features": self.features.overrides(),
        }


def stage_plan(s: Setup, stage: int) -> tuple[dict[str, dict[str, int]], range, StageHost]:
    """Every moment's items (bytes) for `stage`, its layers, and what its ranks put in host
    memory; see the module docstring. The moments come from the planner's parts: the stage's
    persistent state (`flashcp.plan.state`), its layers (`flashcp.plan.layer`), the head and
    loss (`flashcp.plan.head`), the no-grad forwards (`flashcp.plan.forward`), the optimizer
    step (`flashcp.plan.optimizer`) and host memory (`flashcp.plan.host`)."""
    check_features(s.features, s.args.recompute)
    state = stage_state(s, stage)
    layers = stage_layers(s, state)
    head = head_plan(s, state, layers)
    flight = in_flight(s, stage)
    # inputs: all micro-batches of the step are planned at once (ids, positions, labels int64)
    mask = s.batch * s.seq * (2 if s.dpo else 1) * 4 if s.cp == 1 else 0
    inputs = s.grad_accum * (s.tokens * 3 * 8 + mask)
    overhead = GPU_FIXED_BYTES if s.device == "gpu" else 0
    m = Moments({**state.items, "inputs": inputs, "fixed_overhead": overhead})
    micro_acts = layers.micro_bytes + head.micro_extra
    # the other in-flight micro-batches' activations (the MTP depths' apart) and, last stage
    # unchunked, their softmax
    fly = InFlight(
        others=(flight - 1) * micro_acts,
        others_mtp=(flight - 1) * head.micro_mtp,
        held=(flight - 1) * head.softmax_all if state.last else 0,
    )
    buckets = backward_bucket_set(s, state)
    if state.last:
        loss_moments(m, s, state, head, layers, fly, micro_acts=micro_acts,
                     stage_kept=layers.micro_bytes, buckets=buckets)  # fmt: skip
    worst = layers.worst([state.layer_grads(i) for i in state.layers])
    p2p = s.tokens * s.args.hidden_size * state.dt.boundary if s.pp > 1 and not state.last else 0
    m.add(
        "backward: layer",
        **{state.grad_item: worst.grads},
        activations=fly.others + worst.acts,
        mtp_activations=fly.others_mtp,
        logits_loss=fly.held,
        layer_working_set=worst.working,
        attention_kv_gather=worst.gather,
        ep_buffers=worst.ep,
        p2p_buffers=p2p,
        grad_buckets=buckets["layers"],
    )
    embedding_moment(m, state, head, fly, buckets)
    forward_moments(m, s, state, layers, head, fly, micro_acts=micro_acts)
    optimizer_moments(m, s, state)
    if s.device == "gpu":
        m.add_gpu_slack()
    host = stage_host(s, state, sum(layers.offloaded), flight)
    return m.items, state.layers, host


def ranks_per_node(cfg: Config, nnodes: int | None = None) -> int:
    """Ranks on one node: the launch's dp·pp·cp / `nnodes` when given, else
    `hardware.gpus_per_node` (a job smaller than a node fills one node)."""
    world = cfg.parallel.world_size
    if nnodes is not None and nnodes > 0:
        return max(1, world // nnodes)
    return max(1, min(world, int(cfg.hardware.gpus_per_node)))


def plan(
    cfg: Config,
    *,
    device: str | None = None,
    budget_gib: float | None = None,
    host_budget_gib: float | None = None,
    features: Features | None = None,
    nnodes: int | None = None,
    margins: bool = True,
) -> Plan:
    """The memory plan of every rank of `cfg` (see the module docstring), device and host.

    `device` (cpu/gpu) defaults to `run.device` (auto: cpu); `budget_gib` to
    `hardware.memory_gib` and `host_budget_gib` (per node) to `hardware.host_memory_gib`
    (None: no budget, that side fits); `features` to what `cfg` asks for
    (`flashcp.plan.features.features_of`); `nnodes`: the launch's node count (ranks per node
    = world / nnodes; default `hardware.gpus_per_node`). The budgets keep
    `hardware.memory_headroom` and `hardware.host_memory_reserve` free; `margins=False`
    plans against the whole budgets (what fits to the last byte).
    """
    s = setup(cfg, device, features)
    hw = cfg.hardware
    headroom = float(hw.memory_headroom) if margins else 0.0
    reserve = float(hw.host_memory_reserve) if margins else 0.0
    gib = budget_gib if budget_gib is not None else cfg.hardware.memory_gib
    budget = None if gib is None else int(gib * GIB)
    host_gib = host_budget_gib if host_budget_gib is not None else cfg.hardware.host_memory_gib
    per_stage = {}
    for stage in range(s.pp):
        moments, layers, host = stage_plan(s, stage)
        totals = {name: sum(items.values()) for name, items in moments.items()}
        name = max(totals, key=lambda k: totals[k])
        per_stage[stage] = (name, moments, layers, host)
    ranks = []
    host_ranks = []
    checkpoints = cfg.checkpoint.saves
    for rank in range(s.dp * s.pp * s.cp):
        stage = (rank // s.cp) % s.pp
        name, moments, layers, host = per_stage[stage]
        comms = communicators(cfg, rank) if s.device == "gpu" else None
        if comms is not None:  # the same bytes at every moment: the peak moment stays
            moments = {m: {**items, "nccl_communicators": comms.bytes}
                       for m, items in moments.items()}  # fmt: skip
        ranks.append(RankPlan(rank, stage, dict(moments[name]), name, moments, layers, comms))
        writer = rank == stage * s.cp  # dp 0, cp 0 of the stage
        host_ranks.append(HostRank(rank, stage, rank_moments(
            host, writer=writer, gpu=s.device == "gpu", checkpoints=checkpoints,
            async_checkpoints=cfg.checkpoint.async_,
        ), written_bytes(host, writer=writer)))  # fmt: skip
    notes = []
    if s.device == "gpu" and s.compute == "bfloat16":
        notes.append(
            "bf16 activation sizes follow Paddle's O1 rules (matmuls bf16, norms float32); "
            "checked against the allocator on CPU in float32 only"
        )
    if s.features.any:
        on = ", ".join(f"{k}={v}" for k, v in s.features.overrides().items())
        notes.append(f"long-context mechanisms assumed: {on} (`flashcp.plan.features`)")
    host_plan = HostPlan(
        host_ranks,
        ranks_per_node(cfg, nnodes),
        None if host_gib is None else int(host_gib * GIB),
        reserve=reserve,
    )
    return Plan(ranks, budget, s.device, s.compute, s.param_dtype, notes, host_plan,
                s.features, headroom)  # fmt: skip
