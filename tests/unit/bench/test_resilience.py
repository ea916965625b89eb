"""The resilience benchmark's fault schedule (`bench.resilience.draw`): one fault of each kind
at seeded steps, each given the `flashcp train` run and launch attempt it hits, as
`FLASHCP_FAULT` items `flashcp.faults` parses."""

from __future__ import annotations

import pytest

from bench import resilience
from flashcp import faults


@pytest.mark.parametrize("seed", range(6))
def test_each_fault_meets_its_own_launch(seed: int) -> None:
    got = resilience.draw(seed, steps=40, every=4)
    assert sorted(f.kind for f in got) == sorted(resilience.KINDS)
    steps = [f.step for f in got]
    assert steps == sorted(steps) and all(4 < s <= 36 for s in steps)
    assert all(b - a >= resilience.GAP for a, b in zip(steps, steps[1:], strict=False))
    invocation, attempt = 0, 0
    for f in got:  # after a pre-emption the next `flashcp train` starts at attempt 0
        assert (f.invocation, f.attempt) == (invocation, attempt), got
        if f.kind == "preempt":
            invocation, attempt = invocation + 1, 0
        elif f.kind != "failed_save":  # a failed save ends no launch
            attempt += 1
        if f.kind in resilience.ON_SAVE:
            assert f.step % 4 == 0  # a checkpoint step
        if f.kind == "torn_write":
            assert f.rank == 0  # the one writer
    specs = ",".join(f.spec() for f in got if f.kind != "preempt")
    parsed = faults.parse_faults(specs)
    assert [(p.step, p.attempt) for p in parsed] == [
        (f.step, f.attempt) for f in got if f.kind != "preempt"
    ]


def test_the_seed_decides() -> None:
    assert resilience.draw(3, 40, 4) == resilience.draw(3, 40, 4)
    assert resilience.draw(3, 40, 4) != resilience.draw(4, 40, 4)
