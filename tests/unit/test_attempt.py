"""Which launch a process belongs to (`flashcp.attempt`): what `flashcp train` tells the ranks
it starts and relaunches, and how a run's restarts are counted."""

from __future__ import annotations

from flashcp import attempt


def test_attempt_round_trips_through_the_environment() -> None:
    sent = attempt.Attempt(2, 100.5, 130.25)
    assert attempt.current(sent.env()) == sent
    assert sent.relaunch and not attempt.Attempt(0, 1.0, 1.0).relaunch


def test_unset_or_malformed_means_a_first_launch_now() -> None:
    """Ranks started by `paddle.distributed.launch` directly: attempt 0, started when the
    module was imported; a value that does not parse counts as unset."""
    plain = attempt.current({})
    assert plain.index == 0 and plain.started_at == plain.launched_at > 0
    odd = attempt.current({attempt.ENV_ATTEMPT: "two", attempt.ENV_LAUNCHED_AT: "soon"})
    assert odd.index == 0 and odd.launched_at == plain.launched_at
    assert attempt.current({attempt.ENV_ATTEMPT: "-3"}).index == 0

