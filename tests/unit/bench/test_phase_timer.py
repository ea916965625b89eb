"""`bench.phase_timer`: nested phases are charged their exclusive time, and a timed function
computes what the plain one does, its backward timed as its own phase."""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from bench import phase_timer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nested_phases_are_charged_exclusive_time() -> None:
    t = FakeClock()
    clock = phase_timer.PhaseClock(t)
    clock.enter("outer", "forward")
    t.now = 1.0
    with clock.phase("inner", "forward"):
        t.now = 3.0
    t.now = 3.5
    clock.leave()
    with clock.phase("inner", "backward"):
        t.now = 4.0
    assert clock.by_phase() == {
        "outer": {"forward": 1.5, "backward": 0.0, "update": 0.0},
        "inner": {"forward": 2.0, "backward": 0.5, "update": 0.0},
    }
    assert sum(clock.totals.values()) == t.now  # no second counted twice
    clock.reset()
    assert clock.by_phase() == {}
    with pytest.raises(ValueError, match="pass"):
        clock.enter("x", "sideways")


@dataclasses.dataclass
class Pair:
    value: paddle.Tensor
    index: paddle.Tensor


def _net(lin: paddle.nn.Linear, x: paddle.Tensor, scale: int) -> Pair:
    y = paddle.nn.functional.silu(lin(x)) * scale
    return Pair(y, paddle.argmax(y, axis=-1))


def test_a_timed_function_has_the_plain_values_and_gradients() -> None:
    paddle.seed(0)
    lin = paddle.nn.Linear(4, 3)
    x = paddle.randn([5, 4])
    x.stop_gradient = False

    def run(fn):  # type: ignore[no-untyped-def]
        x.clear_gradient()
        lin.clear_gradients()
        out = fn(lin, x, 2)
        (out.value * out.value).sum().backward()
        return out, x.grad.numpy(), lin.weight.grad.numpy()

    want, want_dx, want_dw = run(_net)
    clock = phase_timer.PhaseClock()
    got, got_dx, got_dw = run(phase_timer.timed(clock, "net", _net))
    assert isinstance(got, Pair)
    np.testing.assert_array_equal(got.value.numpy(), want.value.numpy())
    np.testing.assert_array_equal(got.index.numpy(), want.index.numpy())
    np.testing.assert_array_equal(got_dx, want_dx)
    np.testing.assert_array_equal(got_dw, want_dw)
    assert clock.calls[("net", "forward")] == 1 and clock.calls[("net", "backward")] == 1


def test_patches_are_undone() -> None:
    lin = paddle.nn.Linear(2, 2)
    original = lin.forward
    patches = phase_timer.Patches()
    clock = phase_timer.PhaseClock()
    patches.wrap(clock, lin, "forward", "proj", backward=False)
    lin(paddle.ones([1, 2]))
    assert clock.calls[("proj", "forward")] == 1
    patches.remove()
    assert "forward" not in vars(lin) and lin.forward == original
