"""A stage's forward passes without gradients: recompute's first pass over each layer
(``forward: layer``, and ``forward: mtp layer`` for a trained MTP depth) and the DPO reference
pass (``reference forward``). Each holds the layers below kept and one layer's no-grad peak:
whole, or under tiling the larger of its attention moment and its `after` block's (`nograd`),
plus the attention's own chunk buffers."""

from __future__ import annotations

from flashcp.plan import activations as act
from flashcp.plan import moe_rows
from flashcp.plan.head import HeadPlan, InFlight
from flashcp.plan.items import Moments
from flashcp.plan.layer import LayerSet, exchange_bytes
from flashcp.plan.setup import Setup
from flashcp.plan.state import StageState

OFFLOAD_IN_FLIGHT = 2
"""GPU activation offload: copies to the host a forward lets run before it waits for the
oldest (`flashcp.models.offload.MAX_LEAVING`): that many earlier layer inputs may still be on
the device while a layer runs forward."""


def nograd(
    s: Setup, state: StageState, layers: LayerSet, index: int, *, first_pass: bool = True
) -> tuple[float, float]:
    """(peak bytes, excess all-to-all bytes) of layer `index`'s forward without gradients
    beyond its input (recompute's first pass, or the DPO reference pass: `first_pass` False).

    Whole: `act.nograd_forward_transient`, under CP the gathered K/V joining its attention
    moment, with key chunks the chunks' buffers. Tiled (`flashcp.models.tiling`, measured in
    `tests/unit/plan/test_forward_peak.py`): the attention moment over full-length q, k, v as
    untiled, or the `after` block's: the full-length attention output and layer output, and
    per token of one tile its rows of the layer input and of the attention output (copies)
    and the MLP moment."""
    args, dt, T, f = s.args, state.dt, s.tokens, s.features
    pinned = first_pass and args.recompute == "refined"
    moe = args.is_moe_layer(index)
    chunked = bool(f.query_chunk or f.kv_chunk)
    attention = act.nograd_attention(args, dt).bytes(dt) * T + layers.attn_forward
    tile = s.tile
    if not tile:
        buf = moe_rows.expert_rows(args, T, dt, s.ep) if args.num_experts else None
        peak = act.nograd_forward_transient(args, index, dt, buf, pinned=pinned).bytes(dt) * T
        # chunked attention's own buffers count at either moment, CP's gathered K/V at its own
        peak = peak + layers.attn_forward if chunked else max(peak, attention)
        return peak, max(0.0, exchange_bytes(s, dt, index, T) - peak) if moe else 0.0
    tile_buf = moe_rows.expert_rows(args, tile, dt, s.ep) if args.num_experts else None
    H, q = args.hidden_size, args.num_heads * args.head_size
    # the tile's rows of the layer input in the stream's dtype (their float32 upcast, if any,
    # dies at the residual add: it is an argument of the block only)
    per_tile = act.nograd_mlp(args, index, tile_buf).bytes(dt) + H * dt.boundary
    full = q * dt.c + H * dt.boundary + (args.num_heads * 4 if pinned else 0)
    peak = max(attention, full * T + per_tile * tile)
    excess = exchange_bytes(s, dt, index, tile) - per_tile * tile
    return peak, max(0.0, excess) if moe else 0.0


def leaving(s: Setup, layers: LayerSet, i: int) -> float:
    """Under offload, layer i's input on the device during its forward, and on GPU up to
    `OFFLOAD_IN_FLIGHT` earlier layers' inputs whose copies out are still running (CPU copies
    are synchronous)."""
    off = layers.offloaded
    if not off:
        return 0.0
    earlier = off[max(0, i - OFFLOAD_IN_FLIGHT) : i] if s.device == "gpu" else []
    return off[i] + sum(earlier)


def forward_moments(
    m: Moments,
    s: Setup,
    state: StageState,
    layers: LayerSet,
    head: HeadPlan,
    fly: InFlight,
    *,
    micro_acts: float,
) -> None:
    """``forward: layer`` and ``forward: mtp layer`` under recompute, ``reference forward``
    under DPO (module docstring)."""
    mode, kept = s.args.recompute, layers.kept
    if mode != "none" and kept:
        # recompute's first pass: the layers below kept, this layer's no-grad forward
        forward = max(
            (
                (layers.fixed + sum(kept[:i]) + leaving(s, layers, i),
                 *nograd(s, state, layers, index))
                for i, index in enumerate(state.layers)
            ),
            key=sum,
        )  # fmt: skip
        m.add(
            "forward: layer",
            **state.live_grads("forward"),
            activations=fly.others + forward[0],
            mtp_activations=fly.others_mtp,
            logits_loss=fly.held,
            layer_working_set=forward[1],
            ep_buffers=forward[2],
            p2p_buffers=0,
        )
    if mode != "none" and layers.mtp:
        # an MTP depth's block forward (recompute's first pass), after the main head's loss
        # (and the depths below it) ran: every stage layer kept, and the depth's input part
        depth, (own_j, work_j, ep_j) = max(
            (
                (j, (sum(head.mtp_own[:j]) + head.mtp_in, *nograd(s, state, layers, index)))
                for j, index in enumerate(layers.mtp)
            ),
            key=lambda x: sum(x[1]),
        )
        m.add(
            "forward: mtp layer",
            **state.live_grads("forward"),
            activations=fly.others + micro_acts,
            mtp_activations=fly.others_mtp + own_j,
            logits_loss=fly.held + head.softmax_kept * (1 + depth),
            layer_working_set=work_j,
            ep_buffers=ep_j,
        )
    if s.dpo:
        # the reference pass runs with the adapters off (LoRA) or on the reference copy: one
        # layer's no-grad peak over its input (the stream between layers) and the rotary tables
        reference = max((nograd(s, state, layers, i, first_pass=False) for i in state.layers),
                        key=lambda x: x[0], default=(0.0, 0.0))  # fmt: skip
        args, dt, T = s.args, state.dt, s.tokens
        held = (args.hidden_size * dt.boundary + act.stage_extras(args).bytes(dt)) * T
        m.add(
            "reference forward",
            **state.live_grads("forward"),
            activations=int(reference[0] + held) + (layers.norm if state.last else 0),
            logits_loss=head.loss_peak if state.last else 0,
            ep_buffers=reference[1],
        )
