"""Activation recompute for decoder layers: `none`, `full` and `refined`, one resolved version.

`checkpoint(fn, hidden, mode)` runs one decoder layer under Paddle's reentrant recompute
(`paddle.distributed.fleet.utils.recompute`, checked on CPU with PyLayers inside): the first
forward runs without grad and keeps only the layer input; backward reruns the layer under
grad and back-propagates through it, restoring the RNG state first. Inside the layer, the
attention module asks `current_state()` which pass it is in:

* `Phase.FIRST` (grad disabled): resolve the FlashAttention version ONCE (and, under CP,
  the whole `CPPlan`) into a `PinnedAttention`, run the kernel forward, and append the pin
  to the call's FIFO. `refined` also stores the attention output and LSE in the pin.
* `Phase.REPLAY` (backward): take the pins back in the same order. `full` reruns the kernel
  forward (and its backward) on the pinned version; `refined` returns the stored output
  through `StoredAttentionFn`, whose backward runs the kernel backward on the pinned version.
  Neither re-reads `FLAGS_flash_attn_version` or the deterministic flag, unlike upstream
  PaddleFleet's refined-recompute path, which re-resolved the version in the recompute pass.

So attention runs forward once per layer per step under `refined` (twice under `full`) and
every kernel call of one layer in one step uses the same version.

The FIFO belongs to one recompute call of one layer (it lives in the closure the recompute
graph node keeps), not to the layer module: micro-batches may be back-propagated in any order
(1F1B or reversed), a forward whose backward never runs leaves nothing behind (the pins die
with its graph), and a `retain_graph` second backward replays the same pins again.
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

from flashcp import dispatch
from flashcp.attention import allgather_kv as cp_attention
from flashcp.attention.flashmask import (
    dispatch_call_shape,
    flashmask_attention_with_version,
    validate_attention_inputs,
)
from flashcp.kernels import registry


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


def checkpoint(fn: Callable[[paddle.Tensor], paddle.Tensor], hidden: paddle.Tensor, mode: str):
    """`fn(hidden)` with its activations recomputed in backward (`mode` "full" or "refined").

    `fn` closes over everything but the hidden states (positions, rotary tables, the attention
    context). A hidden input that takes no gradient (frozen embeddings, LoRA) is detached
    with gradient enabled, so the layer's own parameters still get theirs.
    """
    if mode not in ("full", "refined"):
        raise ValueError(f"checkpoint mode {mode!r}: use 'full' or 'refined'")

    pins: list[PinnedAttention] = []  # this call's FIFO: filled by FIRST, read by REPLAY

    def run(h: paddle.Tensor) -> paddle.Tensor:
        phase = Phase.REPLAY if paddle.is_grad_enabled() else Phase.FIRST
        with _entered(RecomputeState(mode, phase, pins)):
            return fn(h)

    if hidden.stop_gradient:
        hidden = hidden.detach()
        hidden.stop_gradient = False
    return fleet_recompute(run, hidden, use_reentrant=True, preserve_rng_state=True)


# ------------------------------------------------------------------------ pinned attention


@dataclass
class PinnedAttention:
    """One attention call as the first forward decided it; the replay reuses it unchanged.

    Non-CP: the kernel runs on `(q, k, v)` with the global `mask` and `causal`. CP: `plan`
    holds the group, layout, rebased local mask (here as `mask`, with `causal=False`) and
    scale; K/V are all-gathered before and dK/dV reduce-scattered after the kernel.
    """

    version: int
    device: str
    causal: bool
    mask: Any  # paddle int32 mask, or None
    softmax_scale: float | None
    plan: cp_attention.CPPlan | None
    q_shape: tuple[int, ...]
    out: paddle.Tensor | None = None  # refined only: the first pass's output and LSE
    lse: paddle.Tensor | None = None

    def _kv(self, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        if self.plan is None:
            return k, v
        return cp_attention.gather_kv(k, self.plan), cp_attention.gather_kv(v, self.plan)

    def forward_no_grad(self, q, k, v) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Kernel forward on the pinned version (the first pass runs without grad)."""
        k_all, v_all = self._kv(k, v)
        backend = registry.get_backend(self.version, self.device)
        return backend.forward(
            q, k_all, v_all, self.mask, causal=self.causal, softmax_scale=self.softmax_scale
        )

    def forward_with_grad(self, q, k, v) -> paddle.Tensor:
        """The differentiable call on the pinned version (the `full` replay)."""
        if self.plan is not None:
            out, _ = cp_attention.AllGatherKVAttention.apply(q, k, v, self.plan)
            return out
        return flashmask_attention_with_version(
            q, k, v, self.mask, fa_version=self.version, causal=self.causal, validate=False
        )

    def backward(self, q, k, v, out, lse, dout) -> tuple[Any, Any, Any]:
        """Kernel backward on the pinned version; under CP dK/dV go back to their owners."""
        k_all, v_all = self._kv(k, v)
        backend = registry.get_backend(self.version, self.device)
        dq, dk, dv = backend.backward(
            q,
            k_all,
            v_all,
            out,
            lse,
            self.mask,
            dout,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
        )
        if self.plan is not None:
            dk = cp_attention.scatter_grad(dk, self.plan)
            dv = cp_attention.scatter_grad(dv, self.plan)
        return dq, dk, dv


def pin_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    mask: Any,
    *,
    causal: bool,
    fa4_unavailable: str | None = None,
    cp: bool = False,
    group: Any = None,
    mode: str = "dualchunk_allgather",
    assignment: Any = None,
) -> PinnedAttention:
    """Validate and resolve once: the version (and under CP the plan) every later call uses."""
    shape = tuple(int(s) for s in q.shape)
    if cp:
        cp_attention.check_inputs(q, k, v)
        plan = cp_attention.plan_cp_attention(
            q,
            k,
            mask,
            group=group,
            causal=causal,
            mode=mode,
            assignment=assignment,
            fa4_unavailable=fa4_unavailable,
        )
        return PinnedAttention(
            plan.version, plan.device, False, plan.local_mask, plan.scale, plan, shape
        )
    device = validate_attention_inputs(q, k, v, mask, causal=causal)
    version = dispatch.resolve_current(
        int(q.shape[-1]), policy=fa4_unavailable, **dispatch_call_shape(k, v, mask)
    ).version
    return PinnedAttention(version, device, causal, mask, None, None, shape)


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
        grads = ctx.pinned.backward(q, k, v, out, lse, dout)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_grad, strict=True))
