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

Micro-batches in flight on stage s: 1 with pp = 1; ``min(pp - s, grad_accum)`` under 1F1B;
``grad_accum`` under GPipe (`flashcp.pipeline.schedule`). Ranks of one stage (its dp × cp
ranks) hold equal bytes; ZeRO-1 (`parallel.shard_optimizer`) divides master weights and Adam
moments by dp × cp.

Expert parallelism (`parallel.ep`): a rank holds E/ep routed experts per MoE layer (their
gradients, masters and moments with them; under ZeRO-1 the experts' optimizer state is sharded
over the dp·cp/ep ranks of their edp group instead of dp × cp), its experts compute the rows
the ep ranks send them, and each MoE layer's all-to-all exchanges hold their buffers
(`act.ep_exchange_bytes`) while the layer runs forward or backward: between the combine, the
experts and the permute, so the layer's peak has the larger of them and the MoE backward's
working set (``ep_buffers``: the excess).

What it models is flashcp's code: each rank builds only its stage, directly in
`train.param_dtype` (bf16: float32 `main_grad` accumulation, float32 master weights; LoRA
adapters stay float32), `parallel.shard_optimizer` (`flashcp.optim.zero`), the loss over
final hidden states (`flashcp.models.head`), recompute none / full / refined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flashcp.config.device import compute_dtype, resolve_device
from flashcp.config.schema import Config
from flashcp.models.config import ModelArgs
from flashcp.pipeline.split import split_layers
from flashcp.plan import activations as act
from flashcp.plan.comms import Communicators, communicators
from flashcp.plan.features import Features, features_of
from flashcp.plan.host import HostPlan, HostRank, StageHost, rank_moments
from flashcp.plan.params import (
    is_expert,
    is_mtp,
    layer_parameters,
    stage_buffers,
    stage_parameters,
)

GIB = 2**30

ITEMS: tuple[str, ...] = (
    "params_trained",
    "params_frozen",
    "buffers",
    "gradients",
    "main_grads",
    "grad_shard",
    "master_weights",
    "optimizer_states",
    "dpo_reference",
    "inputs",
    "activations",
    "mtp_params",
    "mtp_activations",
    "layer_working_set",
    "attention_kv_gather",
    "logits_loss",
    "weight_grad_transient",
    "p2p_buffers",
    "ep_buffers",
    "grad_buckets",
    "zero_buffers",
    "optimizer_step_transient",
    "nccl_communicators",
    "fixed_overhead",
)
"""Every item a rank's plan reports (bytes live at the rank's peak; 0 when not live then)."""

ITEM_DOCS: dict[str, str] = {
    "params_trained": "trained parameters in train.param_dtype (LoRA: the adapters)",
    "params_frozen": "frozen parameters in train.param_dtype (LoRA: the base weights)",
    "buffers": "persistent buffers (MoE router selection bias), float32",
    "gradients": "parameter .grad of the trained parameters, in the storage dtype",
    "main_grads": "float32 gradient accumulators (main_grad) when storage is bf16",
    "grad_shard": "ZeRO-2 (gradient sharding): this rank's dp×cp shard of the float32 "
    "gradients, which replaces the full-size gradients and main_grads",
    "master_weights": "float32 master copies of trained parameters (bf16 storage or ZeRO), "
    "÷ dp×cp under parallel.shard_optimizer",
    "optimizer_states": "AdamW moments, 2 × float32 per trained element (÷ dp×cp sharded)",
    "dpo_reference": "the frozen DPO reference copy of the stage (not with LoRA)",
    "inputs": "token ids, positions, labels (int64) and masks of the step's micro-batches",
    "activations": "what autograd keeps for the micro-batches in flight (per recompute mode), "
    "stage inputs, rotary tables, CP masks, final norm",
    "mtp_params": "the multi-token-prediction layers' weights (last stage, model.mtp_layers) "
    "in train.param_dtype: trained with model.mtp_loss_weight > 0 (their gradients and "
    "optimizer state are in those items), else carried frozen",
    "mtp_activations": "what the trained MTP depths keep for backward (embedding, norms, "
    "eh_proj input, block per recompute mode, head), per micro-batch in flight",
    "layer_working_set": "one layer's backward: its activation gradients, and under recompute "
    "its re-run forward",
    "attention_kv_gather": "CP: full-sequence K/V all-gathered for one layer, dK/dV partial "
    "sums and reduce-scatter chunks",
    "logits_loss": "logits and the loss's softmax over the vocabulary (or one chunk of "
    "train.loss_chunk_tokens)",
    "weight_grad_transient": "a weight gradient being formed before it is accumulated (LM "
    "head / embedding), or the head weight upcast for compute (bf16 storage on CPU)",
    "p2p_buffers": "pipeline: the received activation gradient",
    "ep_buffers": "expert parallel: one MoE layer's all-to-all send / receive buffers (token "
    "rows to the experts' ranks and back, or their gradients), beyond the layer's own "
    "working set, which is not live at the same time",
    "grad_buckets": "gradient all-reduce bucket over cp/dp (parallel.grad_bucket_mb); under "
    "ZeRO-2 the float32 buckets being filled and reduce-scattered during backward",
    "zero_buffers": "ZeRO-1 flat reduce-scatter / all-gather buffers",
    "optimizer_step_transient": "pipeline clip's gradient copy and squared-norm temporaries",
    "nccl_communicators": "NCCL communicators this rank creates, one per process group and "
    "one per p2p pair, NCCL_COMMUNICATOR_BYTES each (GPU; 0 on CPU: gloo)",
    "fixed_overhead": "non-tensor device memory: CUDA context, library workspaces, allocator "
    "slack (GPU); 0 on CPU (the allocator counts tensors only)",
}

GPU_FIXED_BYTES = 1 * GIB
"""CUDA context and cuBLAS / cuDNN workspaces (not tensors). NCCL's buffers are planned per
communicator (`flashcp.plan.comms`, item ``nccl_communicators``): before they were, this was
2 GiB for both, so a job with one communicator plans as it did."""
GPU_FRAGMENTATION = 0.05
"""Allocator slack on GPU, as a fraction of the tensor bytes at the peak."""
OFFLOAD_IN_FLIGHT = 2
"""GPU activation offload: copies to the host a forward lets run before it waits for the
oldest (`flashcp.models.offload.MAX_LEAVING`): that many earlier layer inputs may still be on
the device while a layer runs forward."""
CP_MASK_COLUMNS = 4
"""Columns of the rebased (non-causal) local FlashMask mask `[B, 1, S, 4]` int32 that the
attention plan of a micro-batch keeps under CP (`flashcp.attention.context`: one plan per
micro-batch, shared by its layers and their recompute)."""


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
    """The plan of every rank of a job, and the device budget it is checked against."""

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

    @property
    def peak(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.total_bytes, -r.rank))

    @property
    def device_fits(self) -> bool:
        """Every rank within the device budget (or no budget)."""
        return self.budget_bytes is None or all(
            r.total_bytes <= self.budget_bytes for r in self.ranks
        )

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
        """`{"ranks": [{"rank", "stage", "total_bytes", "items"}], "budget_bytes", "fits",
        "host": HostPlan.to_json(), "features": {non-default Features}}`; `fits` is both
        budgets'."""
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
            "fits": self.fits,
            "host": self.host.to_json() if self.host is not None else None,
            "features": self.features.overrides(),
        }


@dataclass(frozen=True)
class Setup:
    """What the plan needs from a config, resolved."""

    args: ModelArgs
    dp: int
    pp: int
    cp: int
    ep: int
    pp_layers: list[int] | None
    schedule: str
    tokens: int
    """Local tokens per micro-batch on a rank: micro_batch_size × seq_len / cp."""
    batch: int
    seq: int
    grad_accum: int
    device: str
    compute: str
    param_dtype: str
    shard: bool
    chunk: int
    lora_targets: list[str] | None
    lora_rank: int
    dpo: bool
    grad_clip: float
    bucket_bytes: int
    features: Features = Features()
    """The long-context mechanisms planned (`flashcp.plan.features`; all off by default)."""

    @property
    def shard_degree(self) -> int:
        return self.dp * self.cp if self.shard else 1

    @property
    def expert_shard_degree(self) -> int:
        """ZeRO-1 sharding of the routed experts' optimizer state: over their edp group (the
        dp·cp/ep ranks holding the same experts)."""
        return self.dp * self.cp // self.ep if self.shard else 1


def setup(cfg: Config, device: str | None = None, features: Features | None = None) -> Setup:
    """Resolve the plan's inputs from `cfg` (on `device`, else `run.device`; `features`: the
    mechanisms to plan, default the ones `cfg` asks for, `features_of`)."""
    dev = device or resolve_device(cfg)
    p, d, t = cfg.parallel, cfg.data, cfg.train
    seq = d.seq_len
    divisor = p.seq_divisor
    if p.pad and seq % divisor:
        seq = -(-seq // divisor) * divisor
    lora = cfg.extras.get("lora")
    return Setup(
        args=cfg.model,
        dp=p.dp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        pp_layers=p.pp_layers,
        schedule=p.pp_schedule,
        tokens=d.micro_batch_size * seq // p.cp,
        batch=d.micro_batch_size,
        seq=seq,
        grad_accum=t.grad_accum,
        device=dev,
        compute=compute_dtype(cfg, dev, check=False),
        param_dtype=t.param_dtype,
        shard=p.shard_optimizer,
        chunk=t.loss_chunk_tokens,
        lora_targets=list(lora.target_modules) if lora is not None else None,
        lora_rank=int(lora.rank) if lora is not None else 0,
        dpo=cfg.run.recipe == "dpo",
        grad_clip=float(t.grad_clip),
        bucket_bytes=int(p.grad_bucket_mb * 2**20),
        features=features_of(cfg) if features is None else features,
    )


def in_flight(s: Setup, stage: int) -> int:
    """Micro-batches forwarded but not yet back-propagated at once on `stage`."""
    if s.pp == 1:
        return 1
    if s.schedule == "gpipe":
        return s.grad_accum
    return min(s.pp - stage, s.grad_accum)


def _numel(specs: list[Any], trained: bool | None = None) -> int:
    return sum(x.numel for x in specs if trained is None or x.trained == trained)


def weight_copies(args: ModelArgs, index: int, tokens: int, dt: act.Dtypes) -> int:
    """Bytes of the bf16 copies of layer `index`'s weight matrices that matmuls save under bf16
    O1 autocast over float32 weights: every matmul casts its weight and keeps the copy for
    backward; the stacked routed experts are not autocast. (bf16 storage with float32 compute
    upcasts without saving the copy: transient, `upcast_transient`.)"""
    if not (dt.autocast and dt.c < dt.param):
        return 0
    # The routed experts' grouped matmuls are not autocast (they cast their inputs to the
    # stored weights' dtype themselves), so only 2-D weights count.
    total = sum(spec.numel for spec in layer_parameters(args, index) if len(spec.shape) == 2)
    return int(total * dt.c)


def upcast_transient(args: ModelArgs, index: int, dt: act.Dtypes, *, frozen: bool) -> int:
    """bf16 storage with float32 compute (CPU): the largest 2-D weight of layer `index` upcast
    for one matmul and, in its backward, upcast again for dx plus (trained) its float32
    gradient, that gradient's bf16 cast and the main_grad hook's float32 cast: 4 (+ 10) bytes
    each. (The stacked experts upcast chunk by chunk: `act.moe_backward_bytes`.)"""
    if not dt.upcast:
        return 0
    largest = max((x.numel for x in layer_parameters(args, index) if len(x.shape) == 2),
                  default=0)  # fmt: skip
    return largest * (4 if frozen else 4 + 4 + 2 + 4)


def check_features(f: Features, recompute: str) -> None:
    """`ValueError` for mechanisms the recompute mode cannot carry: offload moves what a
    recomputed layer keeps, tiling re-runs a recomputed layer's token-wise parts in tiles."""
    needs = [name for name, on in (("offload_activations", f.offload_activations),
                                   ("tile_tokens", f.tile_tokens > 0)) if on]  # fmt: skip
    if needs and recompute == "none":
        raise ValueError(
            f"{' and '.join(needs)} need model.recompute full or refined (it is none)"
        )
    for name in ("tile_tokens", "query_chunk", "kv_chunk"):
        if getattr(f, name) < 0:
            raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(f, name)}")


@dataclass(frozen=True)
class TiledWork:
    """A tiled layer's backward working sets (bytes): while a tile of its token-wise parts
    back-propagates (`mlp`, with `ep` the excess of the MoE all-to-all buffers of one tile),
    and while its attention does (`attention`, beyond the attention's own transient)."""

    mlp: float
    attention: float
    ep: float


def _tile_saved(s: Setup, index: int, dt: act.Dtypes, rows: act.ExpertRows | None) -> act.Counts:
    """Per token of a tile: `act.tile_saved` of layer `index` (with LoRA's), an MoE layer's
    expert buffer sized for one tile (`rows`)."""
    lora_experts = act.experts_adapted(s.args, index, s.lora_targets)
    saved = act.layer_saved(s.args, index, dt, rows, s.ep, experts_lora=lora_experts)
    saved += act.lora_saved(s.args, index, s.lora_targets, s.lora_rank, dt, rows)
    return saved


def tiled_working_sets(
    s: Setup,
    index: int,
    dt: act.Dtypes,
    *,
    saved_tile: act.Counts,
    tile: int,
    copies: float,
    refined: bool,
) -> TiledWork:
    """The backward of a recomputed layer whose token-wise parts run in tiles of `tile` local
    tokens (`flashcp.models.tiling`): the replay keeps, for all T local tokens, only the
    attention core (`act.attention_core`; under refined recompute its output and LSE are
    already kept), the bf16 weight copies autocast saves, and the full-length input/gradient
    tensors (`act.tiled_io`, more of them while the `after` block back-propagates); one tile
    at a time adds what its token-wise parts keep (`act.tile_saved`) and their backward
    transient (dense MLP per token, or the MoE layer's with a tile-sized expert buffer and
    all-to-all exchange). While the attention back-propagates, one tile of the input norm and
    q/k/v projections is what re-runs (`act.attention_part` of the tile)."""
    args, T = s.args, s.tokens
    core = act.attention_core(args, stored=refined)
    full = core.bytes(dt) * T + copies
    mlp_io = act.tiled_io(args, dt, mlp=True).bytes(dt) * T
    attn_io = act.tiled_io(args, dt, mlp=False).bytes(dt) * T
    per_tile = act.tile_saved(saved_tile).bytes(dt) * tile
    if args.is_moe_layer(index):
        rows = act.expert_rows(args, tile, dt, s.ep)
        mlp_t = act.moe_backward_bytes(
            args, dt, rows, tile, experts_trained=s.lora_targets is None,
            lora_experts=act.experts_adapted(args, index, s.lora_targets), ep=s.ep,
        )  # fmt: skip
        lora_experts = act.experts_adapted(args, index, s.lora_targets)
        exchange = act.ep_exchange_bytes(args, dt, tile, s.ep, experts_lora=lora_experts)
        ep_t = max(0.0, exchange - mlp_t)
    else:
        mlp_t = act.mlp_backward_transient(args, index).bytes(dt) * tile
        ep_t = 0.0
    attention = full + attn_io + act.attention_part(saved_tile).bytes(dt) * tile
    return TiledWork(mlp=full + mlp_io + per_tile + mlp_t, attention=attention, ep=ep_t)


def stage_plan(s: Setup, stage: int) -> tuple[dict[str, dict[str, int]], range, StageHost]:
    """Every moment's items (bytes) for `stage`, its layers, and what its ranks put in host
    memory; see the module docstring."""
    args = s.args
    dt = act.Dtypes.of(s.compute, s.param_dtype, s.device, s.features.residual_dtype)
    P = dt.param
    layers = split_layers(args.num_layers, s.pp, s.pp_layers)[stage]
    first, last = stage == 0, stage == s.pp - 1
    specs = stage_parameters(
        args, stage, s.pp, s.pp_layers, lora_targets=s.lora_targets, lora_rank=s.lora_rank,
        ep=s.ep,
    )  # fmt: skip
    trained = [x for x in specs if x.trained]
    n_trained, n_frozen = _numel(specs, True), _numel(specs, False)
    n_shard = s.shard_degree
    # the optimizer shard: routed experts over edp (dp·cp/ep ranks), the rest over dp × cp
    n_expert = sum(x.numel for x in trained if is_expert(x))
    n_state = math.ceil((n_trained - n_expert) / n_shard) + math.ceil(
        n_expert / s.expert_shard_degree
    )
    # LoRA adapters stay float32 whatever train.param_dtype (`flashcp.lora.model`)
    PT = 4 if s.lora_targets is not None else P
    master = PT != 4 or s.shard
    # ZeRO-2 (`parallel.shard_gradients`, with `parallel.shard_optimizer`): no full-size
    # gradient outlives its bucket; the shard of the float32 gradients persists
    zero2 = s.features.shard_gradients and s.shard and n_trained > 0
    T, H, V = s.tokens, args.hidden_size, args.vocab_size
    buf = act.expert_rows(args, T, dt, s.ep) if args.num_experts else None

    def exchange(index: int, tokens: int = T) -> float:
        """Layer `index`'s all-to-all buffers (`act.ep_exchange_bytes`) for `tokens` tokens."""
        lora_experts = act.experts_adapted(args, index, s.lora_targets)
        return act.ep_exchange_bytes(args, dt, tokens, s.ep, experts_lora=lora_experts)

    # the MTP layers' weights, an item of their own (`flashcp.models.mtp`)
    # (trained: PT; frozen: P, but frozen LoRA adapters on them stay float32)
    mtp_trained = sum(x.numel for x in specs if x.trained and is_mtp(x, args))
    mtp_frozen = sum(x.numel for x in specs if not x.trained and is_mtp(x, args))
    mtp_adapters = sum(
        x.numel
        for x in specs
        if not x.trained and is_mtp(x, args) and x.name.endswith(("lora_A", "lora_B"))
    )
    persistent = {
        "params_trained": (n_trained - mtp_trained) * PT,
        "params_frozen": (n_frozen - mtp_frozen) * P,
        "mtp_params": mtp_trained * PT + (mtp_frozen - mtp_adapters) * P + mtp_adapters * 4,
        "buffers": _numel(stage_buffers(args, stage, s.pp, s.pp_layers)) * 4,
        # bf16 storage: fleet's main_grad hooks add each gradient into float32 `main_grad` and
        # release the bf16 `.grad` (`flashcp.optim.zero.attach_main_grad`).
        "gradients": n_trained * PT if PT == 4 and not zero2 else 0,
        "main_grads": n_trained * 4 if PT != 4 and not zero2 else 0,
        "grad_shard": n_state * 4 if zero2 else 0,
        "master_weights": n_state * 4 if master else 0,
        "optimizer_states": 2 * 4 * n_state + 8 * len(trained),
        "dpo_reference": (n_trained + n_frozen) * P if s.dpo and s.lora_targets is None else 0,
    }

    # -- activations of one micro-batch on this stage ------------------------------------
    mode = args.recompute
    lora = s.lora_targets
    f = s.features
    check_features(f, mode)
    offload = f.offload_activations
    extras = act.stage_extras(args)
    if not offload:  # offloaded as the first layer's input (`offloaded` below)
        extras.add("stage input (embedding output / received activation)", "b", H)
    cp_mask = s.batch * s.seq * CP_MASK_COLUMNS * 4 if s.cp > 1 else 0
    attn = act.attention_backward_bytes(
        args, dt, T, s.batch * s.seq, cp=s.cp > 1, query_chunk=f.query_chunk,
        kv_chunk=f.kv_chunk,
    )  # fmt: skip
    attn_forward = act.attention_forward_bytes(
        args, dt, T, s.batch * s.seq, cp=s.cp > 1, query_chunk=f.query_chunk,
        kv_chunk=f.kv_chunk,
    )  # fmt: skip
    tile = min(f.tile_tokens, T) if f.tile_tokens else 0
    tile_buf = act.expert_rows(args, tile, dt, s.ep) if args.num_experts and tile else None
    kept: list[float] = []  # bytes each layer keeps per micro-batch (on the device)
    offloaded: list[float] = []  # bytes each layer moves to host per micro-batch (offload)
    # per layer, the two moments of its backward: (activations besides the layers below,
    # working set, K/V gather) while its MLP back-propagates, and while its attention does
    # (and the MoE layers' all-to-all buffers under ep, while the MLP runs)
    mlp_moment: list[tuple[float, float, float, float]] = []
    attn_moment: list[tuple[float, float, float, float]] = []
    # trained MTP layers (`flashcp.models.mtp`, last stage): each depth's block is planned as
    # one more layer above the stage's own (never offloaded: `DecoderOps.run_mtp`)
    mtp = [args.num_layers + d for d in range(args.mtp_layers)] if last and args.mtp_trained else []
    for pos, index in enumerate([*layers, *mtp]):
        lora_experts = act.experts_adapted(args, index, lora)
        saved = act.layer_saved(args, index, dt, buf, s.ep, experts_lora=lora_experts)
        saved += act.lora_saved(args, index, lora, s.lora_rank, dt, buf)
        frozen_input = first and pos == 0 and lora is not None and mode == "none"
        cut = act.frozen_input_savings(args, index, lora, dt).bytes(dt) if frozen_input else 0.0
        attn_part = act.attention_part(saved).bytes(dt) * T
        attn_t = attn.transient
        if args.is_moe_layer(index):
            assert buf is not None
            mlp_t = act.moe_backward_bytes(
                args, dt, buf, T, experts_trained=lora is None,
                lora_experts=act.experts_adapted(args, index, lora), ep=s.ep,
            )  # fmt: skip
        else:
            mlp_t = act.mlp_backward_transient(args, index).bytes(dt) * T
        # The exchanges run between the MoE's other steps (combine, experts, permute), whose
        # transients are freed by then: the larger of the two is live, the excess is reported.
        ep_t = max(0.0, exchange(index) - mlp_t) if args.is_moe_layer(index) else 0.0
        copies = weight_copies(args, index, T, dt)
        upcast = upcast_transient(args, index, dt, frozen=lora is not None)
        if mode == "none":
            own = saved.bytes(dt) * T - cut * T + copies
            kept.append(own)
            mlp_moment.append((own, mlp_t + upcast, 0.0, ep_t))
            attn_moment.append((attn_part - cut * T + copies, attn_t + upcast,
                                attn.kv_gather, 0.0))  # fmt: skip
            continue
        keep = act.layer_output(args)
        if mode == "refined":
            keep = keep + act.refined_extra(args)
        if offload and index < args.num_layers:
            # the layer's input moves to host (the stage input, or the previous layer's
            # output), with refined recompute its stored attention output and LSE; the last
            # layer's output stays: the final norm (or the send to the next stage) holds it
            moved = keep.bytes(dt) * T
            offloaded.append(moved)
            own = H * dt.boundary * T if pos == len(layers) - 1 else 0.0
        else:
            own = keep.bytes(dt) * T
        kept.append(own)
        if tile:
            work = tiled_working_sets(
                s, index, dt, saved_tile=_tile_saved(s, index, dt, tile_buf), tile=tile,
                copies=copies, refined=mode == "refined",
            )  # fmt: skip
            mlp_moment.append((own, work.mlp + upcast, 0.0, work.ep))
            attn_moment.append((own, work.attention + attn_t + upcast, attn.kv_gather, 0.0))
            continue
        replay = act.recompute_replay_extra(args).bytes(dt) * T + copies
        rerun = saved.bytes(dt) * T - keep.bytes(dt) * T + replay
        mlp_moment.append((own, rerun + mlp_t + upcast, 0.0, ep_t))
        attn_moment.append((own, attn_part + replay + attn_t + upcast, attn.kv_gather, 0.0))
    # the MTP depths' entries apart from the stage's layers
    n_main = len(layers)
    mtp_kept, mtp_mlp, mtp_attn = kept[n_main:], mlp_moment[n_main:], attn_moment[n_main:]
    del kept[n_main:], mlp_moment[n_main:], attn_moment[n_main:]
    norm_bytes = int(act.final_norm(args).bytes(dt) * T) if last else 0
    # per micro-batch: the rotary tables (and stage input) per token; under CP the attention
    # plan's rebased local mask, which every layer of the micro-batch shares
    fixed_bytes = extras.bytes(dt) * T + cp_mask
    micro_acts = int(fixed_bytes + sum(kept)) + norm_bytes
    # The worst moment of a micro-batch's layer backward (layers above i are freed already;
    # under offload the layer's input is back on the device, and the next one to run, the
    # layer below's input, is being prefetched).
    best = (0.0, 0.0, 0.0, 0.0)  # (activations, working set, K/V gather, ep buffers)
    for i in range(len(kept)):
        below = fixed_bytes + sum(kept[:i])
        if offloaded:
            below += offloaded[i] + (offloaded[i - 1] if i > 0 else 0.0)
        for acts_i, work_i, gather_i, ep_i in (mlp_moment[i], attn_moment[i]):
            cand = (below + acts_i, work_i, gather_i, ep_i)
            if sum(cand) > sum(best):
                best = cand
    flight = in_flight(s, stage)

    # inputs: all micro-batches of the step are planned at once (ids, positions, labels int64)
    mask_cols = 2 if s.dpo else 1
    mask = s.batch * s.seq * mask_cols * 4 if s.cp == 1 else 0
    inputs = s.grad_accum * (T * 3 * 8 + mask)

    # -- logits / loss (last stage) ---------------------------------------------------------
    rows = min(s.chunk, T) if s.chunk > 0 else T
    # float32 logits and the cross-entropy's softmax (a bf16 matmul output is cast to float32
    # and dropped before the softmax exists)
    loss_peak = rows * V * 8
    # The loss takes the final hidden states (`flashcp.models.head`): no executor holds the
    # logits; unchunked, the cross-entropy keeps its softmax `[T, V]` until backward.
    softmax_kept = 0 if s.chunk > 0 else T * V * 4
    head_trained = any(x.trained and x.name in ("lm_head.weight",) for x in specs) or (
        args.tie_embeddings
        and any(x.trained and x.name == "model.embed_tokens.weight" for x in specs)
    )
    emb_trained = first and any(x.trained and x.name == "model.embed_tokens.weight" for x in specs)
    # A weight gradient being formed: in its storage dtype, plus (bf16 storage) the float32
    # cast the main_grad hook adds into main_grad (not under ZeRO-2).
    grad_bytes = PT + (4 if PT != 4 and not zero2 else 0)  # ZeRO-2 casts piece by piece
    head_grad = H * V * grad_bytes if head_trained else 0
    # The head matmul's compute-dtype copy of its weight: kept per in-flight micro-batch when
    # unchunked (saved for backward), transient per chunk when chunked.
    head_copy = H * V * dt.c if (last and dt.autocast and dt.c < P) else 0
    if s.chunk > 0:
        loss_peak += head_copy
        # each chunk's gathered hidden rows (saved by its recompute) and the [T] log-probs
        micro_acts += T * (H * dt.res + 2 * 4)
    else:
        micro_acts += head_copy
    # Trained MTP depths (`flashcp.models.mtp`): per micro-batch each keeps its input part
    # (`act.mtp_input_saved`), its block (planned as a layer above the stage's, in the
    # model's recompute mode), its head's saved tensors (and unchunked its softmax and the
    # head weight's compute-dtype copy, as the main head's), and under autocast eh_proj's
    # weight copy. They back-propagate before the stage's layers do.
    mtp_in = act.mtp_input_saved(args, dt).bytes(dt) * T
    mtp_head = act.mtp_head_saved(args, chunked=s.chunk > 0).bytes(dt) * T
    mtp_head += (0 if s.chunk > 0 else head_copy) + (2 * H * H * dt.c if head_copy else 0)
    mtp_own = [mtp_in + own + mtp_head for own in mtp_kept]
    micro_mtp = int(sum(mtp_own))
    softmax_all = softmax_kept * (1 + len(mtp))  # the main head's and each MTP head's
    # an MTP head's / embedding's weight gradient being formed (trained unless under LoRA)
    names = {x.name for x in specs if x.trained}
    mtp_head_grad = mtp_emb_grad = 0
    for index in mtp:
        p = f"model.layers.{index}"
        if f"{p}.shared_head.head.weight" in names:
            mtp_head_grad = H * V * grad_bytes
        if f"{p}.embed_tokens.weight" in names:
            mtp_emb_grad = V * H * grad_bytes
    # The worst moment of an MTP depth's backward (MTP activations, working set, K/V gather,
    # ep buffers): the stage's layers and final norm all kept, the depths below it and its
    # input part, and the main head's gradient of the final hidden states waiting to be added
    # to the MTP branch's.
    stage_kept = int(fixed_bytes + sum(kept)) + norm_bytes
    best_mtp = (0.0, 0.0, 0.0, 0.0)
    for j in range(len(mtp)):
        below = sum(mtp_own[:j]) + mtp_in
        for acts_j, work_j, gather_j, ep_j in (mtp_mlp[j], mtp_attn[j]):
            cand = (below + acts_j, work_j + T * H * 4, gather_j, ep_j)
            if sum(cand) > sum(best_mtp):
                best_mtp = cand
    # bf16 storage, float32 compute: the head's upcast weight exists while its matmul runs
    # (forward, and again for dx in backward), next to one [rows, V] buffer.
    head_upcast = H * V * 4 if (last and dt.upcast) else 0
    loss_peak = max(loss_peak, rows * V * 4 + head_upcast)
    emb_grad = V * H * grad_bytes if emb_trained else 0
    p2p = T * H * dt.boundary if s.pp > 1 and not last else 0

    largest = max((x.numel for x in trained), default=0)
    bucket = min(n_trained * 4, max(s.bucket_bytes, largest * 4))

    def backward_buckets(where: str) -> int:
        """ZeRO-2 (`flashcp.optim.grad_shard`) while backward produces the gradients of
        `where` (the layers, the LM head, the embedding): the float32 buffer of the bucket
        being filled (at most `parallel.grad_bucket_mb`), the float32 piece being
        reduce-scattered (the buffer, or at most a bucket's worth cast from a larger
        parameter's gradient, which never exists whole in float32) with the reduce-scatter's
        temporary (gloo: one piece more; NCCL: its 1/(dp·cp) output), and for the layers the
        parameter's gradient being consumed, in its storage dtype (the head's and the
        embedding's are `weight_grad_transient`)."""
        if not zero2:
            return 0
        if where == "layers":
            group = [x for x in trained if ".layers." in x.name]
        else:
            group = [x for x in trained if x.name.startswith(where)]
        if not group:
            return 0
        big = max(x.numel for x in group)
        piece = min(s.bucket_bytes, big * 4)
        temp = piece // s.shard_degree if s.device == "gpu" else piece
        filling = min(s.bucket_bytes, sum(x.numel for x in group) * 4)
        consumed = big * PT if where == "layers" else 0
        return filling + piece + temp + consumed

    overhead = GPU_FIXED_BYTES if s.device == "gpu" else 0
    base = {**persistent, "inputs": inputs, "fixed_overhead": overhead}
    moments: dict[str, dict[str, int]] = {}

    def moment(name: str, **extra: int) -> None:
        items = {k: 0 for k in ITEMS}
        items.update(base)
        items.update({k: int(v) for k, v in extra.items()})
        moments[name] = items

    # the other in-flight micro-batches' activations (the MTP depths' apart)
    others, others_mtp = (flight - 1) * micro_acts, (flight - 1) * micro_mtp
    held = (flight - 1) * softmax_all if last else 0  # and their softmax (unchunked)
    if last:
        moment(
            "forward: loss",
            activations=others + micro_acts,
            mtp_activations=others_mtp,
            logits_loss=held + loss_peak,
        )
        moment(
            "backward: head",
            activations=others + micro_acts,
            mtp_activations=others_mtp + micro_mtp,
            # the softmax turned gradient in place (chunked: the recomputed chunk's; its
            # re-run forward is the 'forward: loss' peak again), next to the head's weight
            # gradient being formed or (bf16 storage on CPU) the head weight upcast for dx
            logits_loss=held + softmax_all - softmax_kept + rows * V * 4,
            weight_grad_transient=max(head_grad, head_upcast) + T * H * dt.c,
            grad_buckets=backward_buckets("lm_head" if not args.tie_embeddings
                                          else "model.embed_tokens"),
        )
        if mtp:
            moment(
                "forward: mtp loss",  # the last depth's head: every depth's activations kept
                activations=others + micro_acts,
                mtp_activations=others_mtp + micro_mtp,
                logits_loss=held + softmax_all - softmax_kept + loss_peak,
            )
            moment(
                "backward: mtp head",  # its softmax turned gradient, its head's weight gradient
                activations=others + micro_acts,
                mtp_activations=others_mtp + micro_mtp,
                logits_loss=held + softmax_all - softmax_kept + rows * V * 4,
                weight_grad_transient=max(mtp_head_grad, head_upcast) + T * H * dt.c,
                grad_buckets=backward_buckets("layers"),
            )
            moment(
                "backward: mtp layer",
                activations=others + stage_kept,
                mtp_activations=others_mtp + best_mtp[0],
                logits_loss=held,
                layer_working_set=best_mtp[1],
                attention_kv_gather=best_mtp[2],
                ep_buffers=best_mtp[3],
                grad_buckets=backward_buckets("layers"),
            )
            if mtp_emb_grad:
                moment(
                    "backward: mtp embedding",  # its dense weight gradient being formed
                    activations=others + stage_kept,
                    mtp_activations=others_mtp + mtp_in,
                    logits_loss=held,
                    weight_grad_transient=mtp_emb_grad,
                    grad_buckets=backward_buckets("layers"),
                )
        moment(
            "backward: layer",
            activations=others + best[0],
            mtp_activations=others_mtp,
            logits_loss=held,
            layer_working_set=best[1],
            attention_kv_gather=best[2],
            ep_buffers=best[3],
            grad_buckets=backward_buckets("layers"),
        )
    else:
        moment(
            "backward: layer",
            activations=others + best[0],
            mtp_activations=others_mtp,
            layer_working_set=best[1],
            attention_kv_gather=best[2],
            ep_buffers=best[3],
            p2p_buffers=p2p,
            grad_buckets=backward_buckets("layers"),
        )
    if emb_grad:
        moment(
            "backward: embedding",
            activations=others,
            mtp_activations=others_mtp,
            logits_loss=held,
            weight_grad_transient=emb_grad,
            grad_buckets=backward_buckets("model.embed_tokens"),
        )
    def nograd(index: int) -> tuple[float, float]:
        """(peak bytes, excess all-to-all bytes) of layer `index`'s forward without
        gradients (recompute's first pass, the DPO reference pass): whole, or under tiling
        the attention core and the hidden in/out for all tokens, one tile of the token-wise
        parts, and with key chunks the float32 output and LSE the chunks merge into."""
        if not tile:
            peak = act.nograd_forward_transient(args, index, buf).bytes(dt) * T
            if f.query_chunk or f.kv_chunk:  # attention's own buffers, chunk-sized
                peak += attn_forward
            return peak, max(0.0, exchange(index) - peak) if args.is_moe_layer(index) else 0.0
        per_tile = act.nograd_forward_transient(args, index, tile_buf).bytes(dt) * tile
        core = (act.attention_core(args).bytes(dt) + H * (dt.boundary + dt.res)) * T
        peak = core + max(per_tile, attn_forward)
        excess = exchange(index, tile) - per_tile
        return peak, max(0.0, excess) if args.is_moe_layer(index) else 0.0

    def leaving(i: int) -> float:
        """Under offload, layer i's input on the device during its forward, and on GPU up to
        `OFFLOAD_IN_FLIGHT` earlier layers' inputs whose copies out are still running (CPU
        copies are synchronous)."""
        if not offloaded:
            return 0.0
        earlier = offloaded[max(0, i - OFFLOAD_IN_FLIGHT) : i] if s.device == "gpu" else []
        return offloaded[i] + sum(earlier)

    if mode != "none" and kept:
        # recompute's first pass: the layers below kept, this layer's no-grad forward
        forward = max(
            (
                (fixed_bytes + sum(kept[:i]) + leaving(i), *nograd(index))
                for i, index in enumerate(layers)
            ),
            key=sum,
        )
        moment(
            "forward: layer",
            activations=others + forward[0],
            mtp_activations=others_mtp,
            logits_loss=held,
            layer_working_set=forward[1],
            ep_buffers=forward[2],
            p2p_buffers=0,
        )
    if mode != "none" and mtp:
        # an MTP depth's block forward (recompute's first pass), after the main head's loss
        # (and the depths below it) ran: every stage layer kept, and the depth's input part
        depth, (own_j, work_j, ep_j) = max(
            (
                (j, (sum(mtp_own[:j]) + mtp_in, *nograd(index)))
                for j, index in enumerate(mtp)
            ),
            key=lambda x: sum(x[1]),
        )
        moment(
            "forward: mtp layer",
            activations=others + micro_acts,
            mtp_activations=others_mtp + own_j,
            logits_loss=held + softmax_kept * (1 + depth),
            layer_working_set=work_j,
            ep_buffers=ep_j,
        )
    if s.dpo:
        # the reference pass runs with the adapters off (LoRA) or on the reference copy
        reference = max((nograd(i) for i in layers), key=lambda x: x[0], default=(0.0, 0.0))
        moment(
            "reference forward",
            activations=int(reference[0]) + (norm_bytes if last else 0),
            logits_loss=loss_peak if last else 0,
            ep_buffers=reference[1],
        )
    if not master:
        # Paddle's AdamW on the parameters (`flashcp.optim.zero.ParamOptimizer`): the bucketed
        # all-reduce over cp/dp, the squared-norm temporaries (one parameter at a time), and
        # under pp > 1 the pipeline clip's copy of every gradient (Paddle's own clip, pp = 1,
        # scales in place).
        step_transient = largest * 4
        if s.pp > 1 and s.grad_clip > 0:
            step_transient += n_trained * 4
        moment(
            "optimizer step",
            grad_buckets=bucket if s.dp * s.cp > 1 and n_trained else 0,
            optimizer_step_transient=step_transient,
        )
    elif n_trained:
        # Float32 masters (`MasterOptimizer`): per bucket the float32 gradients are flattened
        # and all-reduced / reduce-scattered (`zero_buffers`) while the parameters' gradients
        # are released; then the shard's gradients (÷ N) are clipped into a scaled copy and
        # AdamW steps the masters; the updated shards are all-gathered per bucket.
        shard_grads = n_state * 4
        if not zero2:  # ZeRO-2 reduced every bucket during backward already
            moment("optimizer step: reduce", zero_buffers=2 * bucket)
        # The clip replaces the shard's gradients (views of the bucket buffers) one segment at
        # a time, so at most one bucket's old buffer outlives them; the write-back gathers
        # one bucket at a time.
        moment(
            "optimizer step: update",
            gradients=0,
            main_grads=0,
            grad_shard=0,  # ZeRO-2 hands its shard over (`GradientSharder.take`): the same tensors
            optimizer_step_transient=shard_grads,
            zero_buffers=2 * bucket,
        )
    if s.device == "gpu":
        for items in moments.values():
            tensors = sum(v for k, v in items.items() if k != "fixed_overhead")
            items["fixed_overhead"] += int(GPU_FRAGMENTATION * tensors)
    # what the stage's ranks put in host memory (`flashcp.plan.host`)
    whole = stage_parameters(
        args, stage, s.pp, s.pp_layers, lora_targets=s.lora_targets, lora_rank=s.lora_rank,
    )  # fmt: skip  (the writer gathers the experts of its ep group whole)
    if s.lora_targets is not None:  # the adapters alone
        model_part = _numel(whole, True) * PT
    else:  # every parameter and persistent buffer
        model_part = _numel(whole, True) * PT + _numel(whole, False) * P + persistent["buffers"]
    # float32 masters and both moments: one shard per rank (ZeRO-1), or the stage writer's
    # whole copy; Paddle's AdamW (no masters): its moments, by the stage writer
    shard_part = n_state * (4 + 8)
    host = StageHost(
        offloaded=float(sum(offloaded)),
        flight=flight,
        model_part=model_part,
        optimizer_part=shard_part if master and s.shard else 0,
        writer_optimizer_part=shard_part if master else 8 * n_trained,
    )
    return moments, layers, host


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
) -> Plan:
    """The memory plan of every rank of `cfg` (see the module docstring), device and host.

    `device` (cpu/gpu) defaults to `run.device` (auto: cpu); `budget_gib` to
    `hardware.memory_gib` and `host_budget_gib` (per node) to `hardware.host_memory_gib`
    (None: no budget, that side fits); `features` to what `cfg` asks for
    (`flashcp.plan.features.features_of`); `nnodes`: the launch's node count (ranks per node
    = world / nnodes; default `hardware.gpus_per_node`).
    """
    s = setup(cfg, device, features)
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
    checkpoints = cfg.checkpoint.every > 0
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
        )))  # fmt: skip
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
    )
    return Plan(ranks, budget, s.device, s.compute, s.param_dtype, notes, host_plan,
                s.features)  # fmt: skip
