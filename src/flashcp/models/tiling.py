"""Sequence tiling inside a decoder layer (`model.tile_tokens`): the token-wise parts of a layer
run over the local tokens in tiles, so the layer's backward working set scales with the tile,
not with the local sequence (the TiledMLP idea of ALST, arXiv 2506.13996, written for flashcp).

A decoder layer is attention between two token-wise blocks (`flashcp.models.base.DecoderLayer`):

    q, k, v = before(h)            # norm, q/k/v projections, QK-norm, rotary      (per token)
    o       = attention(q, k, v)   # the only part that mixes tokens
    h'      = after(h, o)          # o_proj, norms, residuals, MLP or MoE (router included)

`tiled(fn, inputs, tile)` runs `before` or `after` over rows `[a, a + tile)` of the token axis
(axis 1) of every input at a time:

* forward (`TiledFn.forward`, no autograd): each tile's outputs are written into preallocated
  full-length outputs; the tile's intermediates die with the tile. Only the inputs are saved
  (references: the layer input `h`, which the layer keeps anyway, the attention output `o`,
  which attention saves anyway, and the rotary tables of the micro-batch);
* backward (`TiledFn.backward`): tile by tile, the tile's inputs are sliced and detached, the
  tile is recomputed with autograd (the RNG state of that tile's forward restored, the forward's
  autocast state re-entered, as Paddle's reentrant recompute does) and back-propagated with the
  tile's rows of the output gradients; parameter gradients accumulate in `.grad` through
  Paddle's autograd (LoRA adapters inside the projections included), and each input's gradient
  is written into its rows of a full-length buffer. At most one tile's intermediates and their
  gradients exist at a time.
* without autograd (the first pass of full recompute, DPO reference passes, evaluation): the
  tiles simply run one after the other into the preallocated outputs, so the forward working
  set is bounded by the tile as well.

What is then full-length per layer: the inputs and outputs of the two blocks (h, q, k, v, o
and the layer output), their gradients, and attention's own buffers (`flashcp.attention`);
`flashcp.plan` counts those, plus one tile's intermediates.

Cost: under full recompute each token-wise block runs forward three times (first pass, replay,
tile recompute) instead of twice, i.e. about +1/4 of the token-wise FLOPs of a step; without
recompute, twice instead of once. Under expert parallelism each tile makes its own MoE exchange
(a counts all-gather and the dispatch and combine all-to-alls per tile and pass): the bytes per
token are unchanged per pass, but the extra tile recompute adds one forward's worth (under full
recompute 8 all-to-all passes' bytes per layer instead of 6), and the number of messages grows
by local_tokens / tile. Every rank of an ep group holds the same number of local tokens, so
every rank runs the same tiles in the same order.

Numerics: per token, a tile runs the same operations on the same row as the untiled layer, so
the forward outputs agree row by row — bitwise wherever the BLAS kernel computes a row the same
way for the tile's row count (on x86 MKL: tiles of >= 16·B rows); weight gradients are sums
over tokens accumulated tile by tile, which changes only their summation order
(`scripts/bench/numerics.py`). LoRA dropout draws its mask per tile, so with `lora.dropout` > 0 the
masks differ from the untiled run's (same distribution; each tile's replay reuses its own).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer
from paddle.distributed.fleet.meta_parallel.parallel_layers.random import get_rng_state_tracker
from paddle.framework import core

from flashcp.cp.layout import chunk_bounds

TileFn = Callable[..., tuple[paddle.Tensor, ...]]
"""A token-wise block: tiles of the inputs `[B, n, ...]` → outputs `[B, n, ...]` (a tuple)."""

TOKEN_AXIS = 1
"""Activations are `[B, L, ...]`: tiles cut axis 1."""


def check_tile_tokens(value: Any) -> int:
    """`value` as an int >= 0, else a ValueError naming `model.tile_tokens`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(
            f"model.tile_tokens must be an integer >= 0 (0 = no tiling), got {value!r}"
        )
    return int(value)


def tiled(
    fn: TileFn,
    inputs: Sequence[paddle.Tensor],
    tile: int,
    tables: Sequence[paddle.Tensor] = (),
) -> tuple[paddle.Tensor, ...]:
    """`fn(*inputs, *tables)` computed over tiles of `tile` tokens (module docstring).

    Every tensor is `[B, L, ...]` with the same L; `inputs` are differentiable activations,
    `tables` per-token constants that take no gradient (the rotary cos/sin). `fn` maps tiles of
    them to a tuple of `[B, n, ...]` outputs and must be token-wise (row t of an output
    depends on row t of the inputs only). `tile` 0, or >= L, calls `fn(*inputs, *tables)` as
    it is: the untiled layer.
    """
    tile = check_tile_tokens(tile)
    everything = [*inputs, *tables]
    length = int(everything[0].shape[TOKEN_AXIS])
    if any(int(x.shape[TOKEN_AXIS]) != length for x in everything):
        raise ValueError(
            f"tiled tensors must share the token axis: {[list(t.shape) for t in everything]}"
        )
    if tile == 0 or tile >= length:
        return fn(*everything)
    bounds = chunk_bounds(length, tile)
    if not paddle.is_grad_enabled():
        return _run_tiles(fn, everything, bounds)
    return TiledFn.apply(fn, bounds, *(_attached(x) for x in inputs), *tables)


def _attached(x: paddle.Tensor) -> paddle.Tensor:
    """An input without gradient (frozen embeddings under LoRA without recompute) detached
    with gradient on, as `flashcp.models.recompute.checkpoint` does: the PyLayer's backward
    must run for the parameters inside `fn` to get theirs."""
    if x.stop_gradient:
        x = x.detach()
        x.stop_gradient = False
    return x


def _rows(x: paddle.Tensor, start: int, stop: int) -> paddle.Tensor:
    """Rows `[start, stop)` of the token axis, contiguous (a Paddle slice is a strided view;
    a tile is small, and every kernel then sees the layout the untiled layer gives it)."""
    part = x[:, start:stop]
    return part if part.is_contiguous() else part.contiguous()


def _run_tiles(
    fn: TileFn,
    inputs: Sequence[paddle.Tensor],
    bounds: list[tuple[int, int]],
    states: list[Any] | None = None,
) -> tuple[paddle.Tensor, ...]:
    """Tiles one after the other (no autograd), each written into full-length outputs."""
    outs: list[paddle.Tensor] = []
    length = bounds[-1][1]
    for start, stop in bounds:
        if states is not None:
            states.append(_rng_state())
        parts = fn(*(_rows(x, start, stop) for x in inputs))
        if not outs:  # (no loop variable outlives the loop: it would hold a tile's output)
            outs = [paddle.empty([int(p.shape[0]), length, *(int(d) for d in p.shape[2:])],
                                 dtype=p.dtype) for p in parts]  # fmt: skip
        with paddle.no_grad():
            for out, part in zip(outs, parts, strict=True):
                out[:, start:stop] = part
        del parts, part  # the tile's outputs die before the next tile runs
    return tuple(outs)


# ------------------------------------------------------------------ RNG and autocast state


def _rng_state() -> tuple[Any, ...]:
    """Everything a tile's replay must restore for random ops (LoRA dropout) to repeat
    (the same four states Paddle's reentrant recompute saves, `RecomputeFunction.forward`)."""
    return (
        paddle.get_rng_state(),
        get_rng_state_tracker().get_states_tracker(),
        np.random.get_state(),
        random.getstate(),
    )


class _RestoredRng:
    """Enter a tile's saved RNG state; leave the current one as it was (Paddle's
    `switch_rng_state_tracker` without the custom state)."""

    def __init__(self, state: tuple[Any, ...]) -> None:
        self.state = state

    def __enter__(self) -> None:
        self.saved = _rng_state()
        self._set(self.state)

    def __exit__(self, *exc: object) -> None:
        self._set(self.saved)

    @staticmethod
    def _set(state: tuple[Any, ...]) -> None:
        paddle.set_rng_state(state[0])
        get_rng_state_tracker().set_states_tracker(state[1])
        np.random.set_state(state[2])
        random.setstate(state[3])


def _autocast_state() -> dict[str, Any]:
    """The caller's autocast (O1/O2, dtype, op lists): the tile replay runs under it, as the
    forward did (Paddle's `RecomputeFunction` does the same)."""
    tracer = paddle.framework._dygraph_tracer()
    level = tracer._amp_level
    white, black = tracer._get_amp_op_list()
    return {
        "enable": level != core.AmpLevel.O0,
        "level": "O2" if level == core.AmpLevel.O2 else "O1",
        "dtype": "float16" if tracer._amp_dtype == "float16" else "bfloat16",
        "custom_white_list": white,
        "custom_black_list": black,
    }


# --------------------------------------------------------------------------- the PyLayer


class TiledFn(PyLayer):
    """Forward tile by tile without autograd; backward recomputes and back-propagates tile by
    tile (module docstring). Saves only its inputs."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, fn: TileFn, bounds: list[tuple[int, int]], *inputs: paddle.Tensor
    ) -> tuple[paddle.Tensor, ...]:
        ctx.fn, ctx.bounds = fn, bounds
        ctx.autocast = _autocast_state()
        ctx.needs_grad = tuple(not x.stop_gradient for x in inputs)
        ctx.states = []
        ctx.save_for_backward(*inputs)
        return _run_tiles(fn, inputs, bounds, ctx.states)

    @staticmethod
    def backward(ctx: Any, *grads: paddle.Tensor | None) -> tuple[paddle.Tensor | None, ...]:  # type: ignore[override]
        inputs = ctx.saved_tensor()
        needs = ctx.needs_grad
        with paddle.no_grad():
            dx = [
                paddle.zeros_like(x) if need else None
                for x, need in zip(inputs, needs, strict=True)
            ]
        for (start, stop), state in zip(ctx.bounds, ctx.states, strict=True):
            rows = []
            for x, need in zip(inputs, needs, strict=True):
                r = _rows(x, start, stop).detach()
                r.stop_gradient = not need
                rows.append(r)
            with _RestoredRng(state), paddle.set_grad_enabled(True):
                with paddle.amp.auto_cast(**ctx.autocast):
                    outs = ctx.fn(*rows)
                pairs = [
                    (o, _rows(g, start, stop))
                    for o, g in zip(outs, grads, strict=True)
                    if g is not None and not o.stop_gradient
                ]
                if pairs:
                    with paddle.amp.auto_cast(enable=False):
                        paddle.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            del outs, pairs
            with paddle.no_grad():
                for buf, r in zip(dx, rows, strict=True):
                    if buf is not None and r.grad is not None:
                        buf[:, start:stop] = r.grad
            del rows
        return tuple(dx)
