"""Activation recompute for decoder layers: `none`, `full` and `refined`, one attention plan.

`checkpoint(fn, hidden, mode)` runs one decoder layer under Paddle's reentrant recompute
(`paddle.distributed.fleet.utils.recompute`, checked on CPU with PyLayers inside): the first
forward runs without grad and keeps only the layer input; backward reruns the layer under
grad and back-propagates through it, restoring the RNG state first. Inside the layer, the
attention module hands its call to `attend(impl, plan, q, k, v)`, which asks `current_state()`
which pass it is in:

* outside recompute: `impl.apply` (the differentiable call on the plan).
* `Phase.FIRST` (grad disabled): pin the call — the `AttentionImpl` and its `AttentionPlan`
  (validated, FlashAttention version resolved, under CP the layout and rebased mask) — run
  the kernel forward, and append the pin to the call's FIFO. `refined` also stores the
  attention output and LSE in the pin.
* `Phase.REPLAY` (backward): take the pins back in the same order. `full` reruns
  `impl.apply` on the pinned plan; `refined` returns the stored output through
  `StoredAttentionFn`, whose backward runs `impl.backward` on the pinned plan. Neither
  re-reads `FLAGS_flash_attn_version` or the deterministic flag, unlike upstream
  PaddleFleet's refined-recompute path, which re-resolved the version in the recompute pass.

So attention runs forward once per layer per step under `refined` (twice under `full`) and
every kernel call of one layer in one step uses the same plan. Any `AttentionImpl` works: this
module knows only the interface (`flashcp.attention.interface`), not what a plan holds.

With `train.offload_activations` the layer input the recompute saves, and `refined`'s stored
output and LSE, wait on the host between the layer's forward and its backward
(`flashcp.models.offload`); the replay reads them back unchanged, so the results are bitwise
those without offload.

The FIFO belongs to one recompute call of one layer (it lives in the closure the recompute
graph node keeps), not to the layer module: micro-batches may be back-propagated in any order
(1F1B or reversed), a forward whose backward never runs leaves nothing behind (the pins die
with its graph). A second backward through a retained graph is not supported: Paddle 3.3.1
frees a PyLayer's context once its backward has run, and a second backward through the
recompute crashes the process (seen on CPU, with or without offload).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import paddle
from paddle.autograd import PyLayer
from paddle.distributed.fleet.utils import recompute as fleet_recompute

from flashcp.attention.interface import AttentionImpl, AttentionPlan
from flashcp.models.offload import OffloadChain


class Phase(enum.Enum):
    FIRST = "first"  # the no-grad forward inside recompute
    REPLAY = "replay"  # the rerun during backward


@dataclass
class RecomputeState:
    """The pass a layer runs in, and the pins of its attention calls (in call order)."""

    mode: str
    phase: Phase
    pins: list[PinnedAttention] = field(default_factory=list)
    cursor: int = 0

    def next_pin(self) -> PinnedAttention:
        """The replay's next pinned call (the same order the first pass pinned them)."""
        if self.cursor >= len(self.pins):
            raise RuntimeError(
                f"recompute replay made attention call #{self.cursor + 1} but the first pass "
                f"pinned only {len(self.pins)}: the layer must call attention the same way in "
                "both passes"
            )
        pin = self.pins[self.cursor]
        self.cursor += 1
        return pin


_local = threading.local()


def current_state() -> RecomputeState | None:
    """The recompute pass the calling layer runs in, or None outside recompute."""
    return getattr(_local, "state", None)


@contextlib.contextmanager
def _entered(state: RecomputeState) -> Iterator[None]:
    previous = current_state()
    _local.state = state
    try:
        yield
    finally:
        _local.state = previous


def checkpoint(
    fn: Callable[[paddle.Tensor], paddle.Tensor],
    hidden: paddle.Tensor,
    mode: str,
    offload: OffloadChain | None = None,
):
    """`fn(hidden)` with its activations recomputed in backward (`mode` "full" or "refined").

    `fn` closes over everything but the hidden states (positions, rotary tables, the attention
    context). A hidden input that takes no gradient (frozen embeddings, LoRA) is detached
    with gradient enabled, so the layer's own parameters still get theirs.

    `offload` (a chain of `flashcp.models.offload`, `train.offload_activations`): what the call
    keeps for backward — `hidden`, and under `refined` the stored attention outputs — moves to
    the host when the call returns and comes back when backward reaches it. The call then
    OWNS `hidden`: its device buffer is released, so the caller must not read it afterwards
    (the layer loop rebinds it to the layer's output; the pipeline runner reads only its
    gradient).
    """
    if mode not in ("full", "refined"):
        raise ValueError(f"checkpoint mode {mode!r}: use 'full' or 'refined'")

    pins: list[PinnedAttention] = []  # this call's FIFO: filled by FIRST, read by REPLAY
    keep = offload.layer(pins) if offload is not None else None

    def run(h: paddle.Tensor) -> paddle.Tensor:
        phase = Phase.REPLAY if paddle.is_grad_enabled() else Phase.FIRST
        with _entered(RecomputeState(mode, phase, pins)):
            out = fn(h)
        if keep is not None and phase is Phase.FIRST:
            keep.forward_done = True
        return out

    original = None
    if hidden.stop_gradient:
        original = hidden
        hidden = hidden.detach()
        hidden.stop_gradient = False
    if keep is None:
        return fleet_recompute(run, hidden, use_reentrant=True, preserve_rng_state=True)
    with keep.hooks(original):
        out = fleet_recompute(run, hidden, use_reentrant=True, preserve_rng_state=True)
    keep.seal()
    return out


# ------------------------------------------------------------------------ pinned attention


@dataclass
class PinnedAttention:
    """One attention call as the first forward planned it; the replay reuses it unchanged."""

    impl: AttentionImpl[Any]
    plan: AttentionPlan
    q_shape: tuple[int, ...]
    out: paddle.Tensor | None = None  # refined only: the first pass's output and LSE
    lse: paddle.Tensor | None = None


def attend(
    impl: AttentionImpl[Any],
    plan: AttentionPlan,
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
) -> paddle.Tensor:
    """The attention output of `impl` on `plan`, pinned or replayed inside recompute."""
    state = current_state()
    if state is None:
        return impl.apply(q, k, v, plan)
    if state.phase is Phase.FIRST:
        pinned = PinnedAttention(impl, plan, tuple(int(s) for s in q.shape))
        out, lse = impl.forward(q, k, v, plan)
        if state.mode == "refined":
            pinned.out, pinned.lse = out, lse
        state.pins.append(pinned)
        return out
    pinned = state.next_pin()
    if tuple(int(s) for s in q.shape) != pinned.q_shape:
        raise RuntimeError(
            f"recompute replay got q {list(q.shape)} but the pinned call had "
            f"{list(pinned.q_shape)}: the layer's replay differs from its first pass"
        )
    if state.mode == "refined":
        return StoredAttentionFn.apply(q, k, v, pinned)
    return pinned.impl.apply(q, k, v, pinned.plan)


class StoredAttentionFn(PyLayer):
    """Refined replay: forward returns the output stored by the first pass (no kernel call);
    backward runs the kernel backward on the pinned version."""

    @staticmethod
    def forward(ctx, q, k, v, pinned: PinnedAttention):  # type: ignore[override]
        out, lse = pinned.out, pinned.lse
        if out is None or lse is None:
            raise RuntimeError("refined recompute: the pinned call has no stored output")
        ctx.pinned = pinned
        ctx.needs_grad = tuple(not t.stop_gradient for t in (q, k, v))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensor()
        pinned = ctx.pinned
        grads = pinned.impl.backward(q, k, v, out, lse, dout, pinned.plan)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_grad, strict=True))
