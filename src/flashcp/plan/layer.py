"""One micro-batch's decoder layers on a stage: what each keeps for backward (on the device,
or moved to host by the offload), and the two moments of each layer's backward — while its MLP
back-propagates (the whole layer still kept) and while its attention does (only the
attention's inputs kept, plus the attention backward and under CP the gathered K/V) — with the
layers below it kept and, under recompute, the layer's re-run forward. The worst of them is the
stage's ``backward: layer`` moment (`LayerSet.worst`); trained MTP depths are planned the same
way as layers above the stage's own (`LayerSet.mtp_*`).

Under tiling (`model.tile_tokens`) a recomputed layer's token-wise parts back-propagate one
tile at a time (`tiled_working_sets`); under expert parallelism each MoE layer's all-to-all
buffers are reported as their excess over the layer's own working set (``ep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from flashcp.models.config import ModelArgs
from flashcp.plan import activations as act
from flashcp.plan import moe_rows
from flashcp.plan.attention_scratch import attention_backward_bytes, attention_forward_bytes
from flashcp.plan.counts import Counts, Dtypes
from flashcp.plan.params import layer_parameters
from flashcp.plan.setup import Setup
from flashcp.plan.state import StageState

CP_MASK_COLUMNS = 4
"""Columns of the rebased (non-causal) local FlashMask mask `[B, 1, S, 4]` int32 that the
attention plan of a micro-batch keeps under CP (`flashcp.attention.context`: one plan per
micro-batch, shared by its layers and their recompute)."""


class Work(NamedTuple):
    """One moment of a layer's backward (bytes): the activations kept besides the layers
    below, the working set, the gathered K/V (CP), the excess of the all-to-all buffers
    (ep) and the gradients formed by then (`flashcp.plan.state.StageState.layer_grads`).
    Moments compare by their sum."""

    acts: float
    working: float
    gather: float
    ep: float
    grads: float = 0.0


NO_WORK = Work(0.0, 0.0, 0.0, 0.0)


def weight_copies(args: ModelArgs, index: int, tokens: int, dt: Dtypes) -> int:
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


def upcast_transient(args: ModelArgs, index: int, dt: Dtypes, *, frozen: bool) -> int:
    """bf16 storage with float32 compute (CPU): the largest 2-D weight of layer `index` upcast
    for one matmul (4 bytes per element: in its backward for dx, freed before dW forms); a
    trained one then holds its float32 gradient with that gradient's bf16 cast, then the bf16
    one with the main_grad hook's float32 cast: 6 bytes (measured with Paddle's allocator,
    `tests/unit/plan/test_layer.py`). (The stacked experts upcast chunk by chunk:
    `moe_rows.moe_backward_bytes`.)"""
    if not dt.upcast:
        return 0
    largest = max((x.numel for x in layer_parameters(args, index) if len(x.shape) == 2),
                  default=0)  # fmt: skip
    return largest * (4 if frozen else 4 + 2)


@dataclass(frozen=True)
class TiledWork:
    """A tiled layer's backward working sets (bytes): while a tile of its token-wise parts
    back-propagates (`mlp`, with `ep` the excess of the MoE all-to-all buffers of one tile),
    and while its attention does (`attention`, beyond the attention's own transient)."""

    mlp: float
    attention: float
    ep: float


def _tile_saved(s: Setup, index: int, dt: Dtypes, rows: moe_rows.ExpertRows | None) -> Counts:
    """Per token of a tile: `act.tile_saved` of layer `index` (with LoRA's), an MoE layer's
    expert buffer sized for one tile (`rows`)."""
    lora_experts = act.experts_adapted(s.args, index, s.lora_targets)
    saved = act.layer_saved(s.args, index, dt, rows, s.ep, experts_lora=lora_experts)
    saved += act.lora_saved(s.args, index, s.lora_targets, s.lora_rank, dt, rows)
    return saved


def tiled_working_sets(
    s: Setup,
    index: int,
    dt: Dtypes,
    *,
    saved_tile: Counts,
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
        rows = moe_rows.expert_rows(args, tile, dt, s.ep)
        mlp_t = moe_rows.moe_backward_bytes(
            args, dt, rows, tile, experts_trained=s.lora_targets is None,
            lora_experts=act.experts_adapted(args, index, s.lora_targets), ep=s.ep,
        )  # fmt: skip
        lora_experts = act.experts_adapted(args, index, s.lora_targets)
        exchange = moe_rows.ep_exchange_bytes(args, dt, tile, s.ep, experts_lora=lora_experts)
        ep_t = max(0.0, exchange - mlp_t)
    else:
        mlp_t = act.mlp_backward_transient(args, index).bytes(dt) * tile
        ep_t = 0.0
    attention = full + attn_io + act.attention_part(saved_tile).bytes(dt) * tile
    return TiledWork(mlp=full + mlp_io + per_tile + mlp_t, attention=attention, ep=ep_t)



def exchange_bytes(s: Setup, dt: Dtypes, index: int, tokens: int) -> float:
    """Layer `index`'s all-to-all buffers (`moe_rows.ep_exchange_bytes`) for `tokens` tokens."""
    lora_experts = act.experts_adapted(s.args, index, s.lora_targets)
    return moe_rows.ep_exchange_bytes(s.args, dt, tokens, s.ep, experts_lora=lora_experts)


@dataclass
class LayerSet:
    """A micro-batch's layers on one stage (module docstring), per layer in stage order."""

    kept: list[float] = field(default_factory=list)
    """Bytes each layer keeps on the device for backward."""
    offloaded: list[float] = field(default_factory=list)
    """Bytes each layer moves to host (activation offload; empty without)."""
    backward: list[tuple[Work, Work]] = field(default_factory=list)
    """Each layer's two backward moments: (MLP, attention)."""
    mtp: list[int] = field(default_factory=list)
    """The trained MTP depths' layer indices (last stage)."""
    mtp_kept: list[float] = field(default_factory=list)
    mtp_backward: list[tuple[Work, Work]] = field(default_factory=list)
    fixed: float = 0.0
    """Per micro-batch besides the layers: rotary tables, the stage input (without offload)
    and under CP the attention plan's rebased local mask, shared by every layer."""
    norm: int = 0
    """The last stage's final norm."""
    attn_forward: float = 0.0
    """What one attention forward holds beyond its inputs and output (chunked: its chunks)."""

    @property
    def micro_bytes(self) -> int:
        """What one micro-batch keeps on the device for the stage's layers and final norm."""
        return int(self.fixed + sum(self.kept)) + self.norm

    def worst(self, grads: Sequence[tuple[float, float]] = ()) -> Work:
        """The worst moment of a micro-batch's layer backward: layer i back-propagating with
        the layers below it kept (the layers above are freed already; under offload the
        layer's input is back on the device, and the next one to run, the layer below's
        input, is being prefetched) and the gradients formed by then, `grads[i]` for its MLP's
        and its attention's moment."""
        best = NO_WORK
        for i in range(len(self.kept)):
            below = self.fixed + sum(self.kept[:i])
            if self.offloaded:
                below += self.offloaded[i] + (self.offloaded[i - 1] if i > 0 else 0.0)
            formed = grads[i] if grads else (0.0, 0.0)
            for part, g in zip(self.backward[i], formed, strict=True):
                cand = Work(below + part.acts, part.working, part.gather, part.ep, g)
                if sum(cand) > sum(best):
                    best = cand
        return best


def stage_layers(s: Setup, state: StageState) -> LayerSet:
    """The `LayerSet` of `state`'s stage (and its trained MTP depths)."""
    args, dt, T, H = s.args, state.dt, s.tokens, s.args.hidden_size
    mode, lora, f = args.recompute, s.lora_targets, s.features
    offload = f.offload_activations
    buf = moe_rows.expert_rows(args, T, dt, s.ep) if args.num_experts else None
    extras = act.stage_extras(args)
    # CPU float32 RMSNorm keeps no input (`act.layer_saved`): without recompute the embedding
    # output is kept by nothing; a received activation and a sent output are held by the
    # pipeline schedule for the stage's backward
    numpy_norms = dt.numpy_rmsnorm(args.family.norm) and mode == "none"
    if not offload and not (numpy_norms and state.first):  # offloaded: `offloaded` below
        extras.add("stage input (embedding output / received activation)", "b", H)
    if numpy_norms and not state.last:
        extras.add("stage output (held for the pipeline's backward)", "b", H)
    cp_mask = s.batch * s.seq * CP_MASK_COLUMNS * 4 if s.cp > 1 else 0
    chunks = {"cp": s.cp > 1, "query_chunk": f.query_chunk, "kv_chunk": f.kv_chunk}
    attn = attention_backward_bytes(args, dt, T, s.batch * s.seq, **chunks)
    out = LayerSet(
        attn_forward=attention_forward_bytes(args, dt, T, s.batch * s.seq, **chunks),
        fixed=extras.bytes(dt) * T + cp_mask,
        norm=int(act.final_norm(args).bytes(dt) * T) if state.last else 0,
    )
    tile = s.tile
    tile_buf = moe_rows.expert_rows(args, tile, dt, s.ep) if args.num_experts and tile else None
    kept: list[float] = []
    backward: list[tuple[Work, Work]] = []
    # trained MTP layers (`flashcp.models.mtp`, last stage): each depth's block is planned as
    # one more layer above the stage's own (never offloaded: `DecoderOps.run_mtp`)
    if state.last and args.mtp_trained:
        out.mtp = [args.num_layers + d for d in range(args.mtp_layers)]
    layers = state.layers
    for pos, index in enumerate([*layers, *out.mtp]):
        lora_experts = act.experts_adapted(args, index, lora)
        saved = act.layer_saved(args, index, dt, buf, s.ep, experts_lora=lora_experts)
        saved += act.lora_saved(args, index, lora, s.lora_rank, dt, buf)
        frozen_input = state.first and pos == 0 and lora is not None and mode == "none"
        cut = act.frozen_input_savings(args, index, lora, dt).bytes(dt) if frozen_input else 0.0
        attn_part = act.attention_part(saved).bytes(dt) * T
        attn_t = attn.transient
        if args.is_moe_layer(index):
            assert buf is not None
            mlp_t = moe_rows.moe_backward_bytes(
                args, dt, buf, T, experts_trained=lora is None,
                lora_experts=act.experts_adapted(args, index, lora), ep=s.ep,
            )  # fmt: skip
        else:
            mlp_t = act.mlp_backward_transient(args, index).bytes(dt) * T
        # The exchanges run between the MoE's other steps (combine, experts, permute), whose
        # transients are freed by then: the larger of the two is live, the excess is reported.
        moe = args.is_moe_layer(index)
        ep_t = max(0.0, exchange_bytes(s, dt, index, T) - mlp_t) if moe else 0.0
        copies = weight_copies(args, index, T, dt)
        upcast = upcast_transient(args, index, dt, frozen=lora is not None)
        if mode == "none":
            own = saved.bytes(dt) * T - cut * T + copies
            kept.append(own)
            backward.append((Work(own, mlp_t + upcast, 0.0, ep_t),
                             Work(attn_part - cut * T + copies, attn_t + upcast,
                                  attn.kv_gather, 0.0)))  # fmt: skip
            continue
        keep = act.layer_output(args)
        if mode == "refined":
            keep = keep + act.refined_extra(args)
        # the last layer's output: the final norm holds it (or the pipeline the sent one),
        # unless that is the numpy RMSNorm, which keeps no input (`act.layer_saved`)
        out_freed = pos == len(layers) - 1 and state.last and dt.numpy_rmsnorm(args.family.norm)
        if offload and index < args.num_layers:
            # the layer's input moves to host (the stage input, or the previous layer's
            # output), with refined recompute its stored attention output and LSE; the last
            # layer's output stays where something holds it
            out.offloaded.append(keep.bytes(dt) * T)
            own = H * dt.boundary * T if pos == len(layers) - 1 and not out_freed else 0.0
        else:
            own = (keep.bytes(dt) - (H * dt.boundary if out_freed else 0)) * T
        kept.append(own)
        if tile:
            work = tiled_working_sets(
                s, index, dt, saved_tile=_tile_saved(s, index, dt, tile_buf), tile=tile,
                copies=copies, refined=mode == "refined",
            )  # fmt: skip
            backward.append((Work(own, work.mlp + upcast, 0.0, work.ep),
                             Work(own, work.attention + attn_t + upcast, attn.kv_gather, 0.0)))
            continue
        replay = act.recompute_replay_extra(args).bytes(dt) * T + copies
        # the re-run forward's saved set, less what stays kept (`layer_saved` counts the
        # output only where the next norm keeps it: not the numpy RMSNorm's)
        counted = keep.bytes(dt) - (H * dt.boundary if dt.numpy_rmsnorm(args.family.norm) else 0)
        rerun = (saved.bytes(dt) - counted) * T + replay
        backward.append((Work(own, rerun + mlp_t + upcast, 0.0, ep_t),
                         Work(own, attn_part + replay + attn_t + upcast, attn.kv_gather, 0.0)))
    # the MTP depths' entries apart from the stage's layers
    n = len(layers)
    out.kept, out.mtp_kept = kept[:n], kept[n:]
    out.backward, out.mtp_backward = backward[:n], backward[n:]
    return out
