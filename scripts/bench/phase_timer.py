"""Explicit timers around the phases of one training step, forward AND backward, on a
synchronous CPU: where every second of a step goes.

Method. A phase is a function the step calls (a module's forward, the router, the permute,
...). `timed(clock, name, fn)` returns `fn` wrapped so that

* its forward runs between `clock.enter(name, "forward")` and `clock.leave()`;
* its backward runs as ONE call too: the wrapper runs `fn` on detached copies of its
  differentiable tensor inputs, recording `fn`'s own autograd graph, and hands the outer graph
  a `PyLayer` node whose backward back-propagates the incoming gradients through that inner
  graph (`paddle.autograd.backward`) between `clock.enter(name, "backward")` and
  `clock.leave()`, then returns the inner inputs' gradients. Parameters used inside `fn`
  receive their gradients from the inner pass, as they would from the outer one.

The computation is the same: the same kernels on the same values, only split over separate
graphs, so the forward (the loss) is bitwise the plain step's; in backward the engine may add
a tensor's three or more gradient contributions (e.g. a MoE input's: router, permute, shared
expert) in another order, so gradients agree to float32 rounding (the benchmark checks them
under the numerics rule). Phases nest (the routed experts contain their GEMMs): `PhaseClock`
keeps a stack and charges each phase its EXCLUSIVE time (its own minus its nested phases'), so
the phases never count a second twice and their sum is at most the step. What the step spends
outside every phase — residual adds, reshapes, the autograd engine between the phases, the
wrappers' own bookkeeping — is the unattributed remainder, reported as such; the wrappers'
cost shows as the instrumented step minus the plain one, both timed in the same rounds.

Times are process CPU seconds (`time.process_time`): on one thread (OMP_NUM_THREADS=1) the
step's own work, which other jobs sharing the cores do not inflate.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PASSES = ("forward", "backward", "update")
"""A phase's passes: its forward, its backward, and the optimizer's update (a phase of its own)."""


class PhaseClock:
    """Exclusive seconds per (phase, pass) from nested `enter` / `leave` calls."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.totals: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [key, start, nested seconds]

    def enter(self, name: str, pass_: str) -> None:
        if pass_ not in PASSES:
            raise ValueError(f"pass {pass_!r}: use one of {PASSES}")
        self._stack.append([(name, pass_), self.clock(), 0.0])

    def leave(self) -> None:
        key, start, nested = self._stack.pop()
        spent = self.clock() - start
        self.totals[key] += spent - nested
        self.calls[key] += 1
        if self._stack:
            self._stack[-1][2] += spent

    @contextmanager
    def phase(self, name: str, pass_: str) -> Iterator[None]:
        self.enter(name, pass_)
        try:
            yield
        finally:
            self.leave()

    def reset(self) -> None:
        if self._stack:
            raise RuntimeError(f"reset inside phase {self._stack[-1][0]}")
        self.totals.clear()
        self.calls.clear()

    def by_phase(self) -> dict[str, dict[str, float]]:
        """`{phase: {"forward": s, "backward": s}}` (0 for a pass that did not run)."""
        out: dict[str, dict[str, float]] = {}
        for (name, pass_), seconds in self.totals.items():
            out.setdefault(name, dict.fromkeys(PASSES, 0.0))[pass_] += seconds
        return out


def _leaves(value: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The top-level items of a function's result (a tensor, a tuple / list, a dataclass) and
    how to rebuild the result from them."""
    if isinstance(value, tuple | list):
        kind = type(value)
        return list(value), lambda items: kind(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        items = [getattr(value, n) for n in names]
        return items, lambda new: dataclasses.replace(value, **dict(zip(names, new, strict=True)))
    return [value], lambda items: items[0]


def _differentiable(x: Any) -> bool:
    import paddle

    return isinstance(x, paddle.Tensor) and x.dtype.name.lower().startswith(
        ("float", "bfloat")
    ) and not x.stop_gradient  # fmt: skip


def _phase_layer() -> Any:
    import paddle
    from paddle.autograd import PyLayer

    class _Phase(PyLayer):
        @staticmethod
        def forward(ctx, box, *inputs):  # type: ignore[no-untyped-def, override]
            inner = []
            for x in inputs:
                d = x.detach()
                d.stop_gradient = False
                inner.append(d)
            with box["clock"].phase(box["name"], "forward"), paddle.enable_grad():
                result = box["run"](*inner)
            leaves, rebuild = _leaves(result)
            diff = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
            box.update(leaves=leaves, rebuild=rebuild, diff=diff)
            ctx.box = box
            ctx.inner = inner
            ctx.outs = [leaves[i] for i in diff]
            return tuple(leaves[i].detach() for i in diff)

        @staticmethod
        def backward(ctx, *grads):  # type: ignore[no-untyped-def, override]
            box = ctx.box
            pairs = [(o, g) for o, g in zip(ctx.outs, grads, strict=True) if g is not None]
            with box["clock"].phase(box["name"], "backward"):
                if pairs:
                    paddle.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            out = tuple(x.grad if x.grad is not None else paddle.zeros_like(x) for x in ctx.inner)
            ctx.outs = ctx.inner = None  # the inner graph dies with this pass
            return out

    return _Phase


_PHASE: Any = None


def timed(
    clock: PhaseClock, name: str, fn: Callable[..., Any], *, backward: bool = True
) -> Callable[..., Any]:
    """`fn` with its forward and backward timed as phase `name` (module docstring). Tensor
    positional arguments that carry gradients go through the phase's `PyLayer`; everything
    else (ints, plans, tensors without gradient) reaches `fn` unchanged. `backward=False`:
    only the forward is timed (a phase whose result carries no gradient, e.g. a plan)."""
    import paddle

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _PHASE
        slots = [i for i, a in enumerate(args) if _differentiable(a)]
        if not backward or not slots or not paddle.is_grad_enabled():
            with clock.phase(name, "forward"):
                return fn(*args, **kwargs)

        def run(*tensors: Any) -> Any:
            full = list(args)
            for i, t in zip(slots, tensors, strict=True):
                full[i] = t
            return fn(*full, **kwargs)

        if _PHASE is None:
            _PHASE = _phase_layer()
        box: dict[str, Any] = {"clock": clock, "name": name, "run": run}
        outs = _PHASE.apply(box, *[args[i] for i in slots])
        if not box["diff"]:
            return box["rebuild"](box["leaves"])
        outs = [outs] if isinstance(outs, paddle.Tensor) else list(outs)
        leaves = list(box["leaves"])
        for i, o in zip(box["diff"], outs, strict=True):
            leaves[i] = o
        return box["rebuild"](leaves)

    return wrapper


class Patches:
    """Attribute replacements (instance methods, module functions) undone by `remove`."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def wrap(
        self, clock: PhaseClock, owner: Any, attr: str, name: str, *, backward: bool = True
    ) -> None:
        """`owner.attr` (a method or a module function) timed as phase `name` (`timed`)."""
        self.set(owner, attr, timed(clock, name, getattr(owner, attr), backward=backward))

    def set(self, owner: Any, attr: str, value: Any) -> None:
        """`owner.attr = value` until `remove`."""
        own = attr in vars(owner)
        self._saved.append((owner, attr, vars(owner).get(attr), own))
        setattr(owner, attr, value)

    def remove(self) -> None:
        for owner, attr, value, own in reversed(self._saved):
            if own:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)
        self._saved.clear()
