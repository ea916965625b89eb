"""The attention interface: plan → forward → backward, and one differentiable `apply` on top.

Every attention implementation (`flashcp.attention.local` for the whole sequence on this rank,
`flashcp.attention.allgather_kv` for all-gather-KV context parallelism, the file of a new CP
mode) is an `AttentionImpl`:

* `plan(q, k, v, ctx)`: everything decided before compute — validate the inputs, resolve the
  effective FlashAttention version ONCE, and under CP the layout and this rank's rebased mask.
  An `AttentionPlan` is immutable: forward, backward and activation recompute reuse it, so
  one call (and, through `AttentionContext.plan`, one micro-batch) runs on one version.
* `forward(q, k, v, plan) -> (out, lse)`: the kernel forward, no autograd.
* `backward(q, k, v, out, lse, dout, plan) -> (dq, dk, dv)`: the kernel backward on the plan's
  version; dk/dv are returned to the ranks that own k/v (reduce-scattered under CP).
* `apply(q, k, v, plan) -> out`: the differentiable call, `AttentionFn` (one PyLayer for every
  implementation) driving `forward` and, in backward, `backward` with the same plan.

The model knows nothing else about attention: `flashcp.attention.registry.implementation_for`
picks the implementation, `AttentionContext.plan` plans, and recompute pins `(impl, plan)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import paddle
from paddle.autograd import PyLayer

if TYPE_CHECKING:  # the context imports this module (plans are cached there)
    from flashcp.attention.context import AttentionContext


@dataclass(frozen=True)
class AttentionPlan:
    """What one attention call decided before compute; the kernel calls read only this."""

    version: int
    """The effective FlashAttention version (2, 3 or 4), resolved once for the call."""
    device: str
    """Where the kernels run (`flashcp.kernels.registry.device_of`)."""
    mask: Any
    """The int32 mask `[B, Hm, Sk, C]` the kernel reads (paddle), or None."""
    causal: bool
    """The kernel's own causal flag (False under CP: causality is in the rebased mask)."""
    scale: float | None
    """The softmax scale handed to the kernel (None: the kernel's head_dim ** -0.5)."""


PlanT = TypeVar("PlanT", bound=AttentionPlan)
"""The plan type of one implementation (`CPPlan` for all-gather KV)."""


def grad_needed(*tensors: paddle.Tensor) -> bool:
    """Whether autograd must record a call on `tensors` (grad mode on, one input needs it)."""
    return paddle.is_grad_enabled() and any(not t.stop_gradient for t in tensors)


class AttentionImpl(ABC, Generic[PlanT]):
    """One attention algorithm: plan before compute, kernel forward/backward on its plan."""

    name: str = "attention"

    @abstractmethod
    def plan(self, q: Any, k: Any, v: Any, ctx: AttentionContext) -> PlanT:
        """Validate and decide everything (version, layout, mask) before any compute."""

    @abstractmethod
    def forward(self, q: Any, k: Any, v: Any, plan: PlanT) -> tuple[Any, Any]:
        """The kernel forward on the plan's version: `(out, lse)`, no autograd."""

    @abstractmethod
    def backward(
        self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, plan: PlanT
    ) -> tuple[Any, Any, Any]:
        """The kernel backward on the plan's version: `(dq, dk, dv)` for this rank's inputs."""

    def apply_with_lse(self, q: Any, k: Any, v: Any, plan: PlanT) -> tuple[Any, Any]:
        """`(out, lse)`, differentiable in q/k/v (lse is not); without grad, the plain forward."""
        if grad_needed(q, k, v):
            return AttentionFn.apply(q, k, v, self, plan)
        return self.forward(q, k, v, plan)

    def apply(self, q: Any, k: Any, v: Any, plan: PlanT) -> Any:
        """The attention output, differentiable in q/k/v."""
        return self.apply_with_lse(q, k, v, plan)[0]


class AttentionFn(PyLayer):
    """`impl.forward` in forward; `impl.backward` with the saved plan in backward.

    The plan (and with it the FlashAttention version) travels on `ctx`: backward never reads a
    flag again, so forward and backward use one kernel family (the PaddleFleet PR #1396 bug).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Any, k: Any, v: Any, impl: AttentionImpl[Any], plan: AttentionPlan
    ) -> tuple[Any, Any]:
        out, lse = impl.forward(q, k, v, plan)
        ctx.impl, ctx.plan = impl, plan
        ctx.needs_grad = tuple(not t.stop_gradient for t in (q, k, v))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, *_lse_grad: Any) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensor()
        if dout is None:
            dout = paddle.zeros_like(out)
        grads = ctx.impl.backward(q, k, v, out, lse, dout, ctx.plan)
        # Paddle wants None exactly where a forward input has stop_gradient=True (e.g. LoRA on
        # q_proj and v_proj only); a CP backward still ran its collectives on every rank.
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_grad, strict=True))
