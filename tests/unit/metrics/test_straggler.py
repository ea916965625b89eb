"""Slow ranks named (`flashcp.metrics.straggler`): compute time over the stage's median, above
the threshold for a whole window of steps, and cleared after a window without."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from flashcp.config import build_config
from flashcp.distributed.dims import ParallelDims
from flashcp.metrics.straggler import Straggler, StragglerWatch, stage_ratios


def test_ratios_are_taken_within_each_pipeline_stage() -> None:
    """Stages do different work: stage 1's ranks are slower than stage 0's by design, and only
    rank 3 is slow among its stage's."""
    got = stage_ratios(np.array([1.0, 1.0, 2.0, 3.0, 2.0]), [0, 0, 1, 1, 1])
    np.testing.assert_allclose(got, [1.0, 1.0, 1.0, 1.5, 1.0])
    np.testing.assert_allclose(stage_ratios(np.array([2.0, 0.0]), [0, 1]), [1.0, 1.0])  # alone
    np.testing.assert_allclose(stage_ratios(np.zeros(2), [0, 0]), [1.0, 1.0])


def test_a_rank_slow_for_a_whole_window_is_named_then_cleared() -> None:
    watch = StragglerWatch([0, 0, 0, 0], ratio=1.2, window=3)
    slow = [1.0, 1.0, 1.6, 1.0]
    assert watch.observe(slow) == (None, None)
    assert watch.observe(slow) == (None, None)  # not yet a whole window
    named, line = watch.observe(slow)
    assert named == Straggler(2, 1.6) and line is not None
    assert "straggler: rank 2 computed 1.60x the median" in line and "3 steps" in line
    assert named.metrics() == {"straggler/rank": 2.0, "straggler/ratio": 1.6}
    assert watch.observe([1.0, 1.0, 1.0, 1.0]) == (Straggler(2, 1.6), None)  # still named
    watch.observe([1.0, 1.0, 1.0, 1.0])
    cleared, line = watch.observe([1.0, 1.0, 1.0, 1.0])
    assert cleared is None and line is not None and "rank 2 is back within 1.2x" in line


def test_one_slow_step_is_noise_and_a_watch_can_be_off() -> None:
    watch = StragglerWatch([0, 0], ratio=1.2, window=2)
    assert watch.observe([1.0, 3.0]) == (None, None)
    assert watch.observe([1.0, 1.0]) == (None, None)  # rank 1 was slow at one step only
    assert watch.observe([1.0, 1.0]) == (None, None)
    off = StragglerWatch([0, 0], ratio=1.2, window=0)
    assert [off.observe([1.0, 9.0]) for _ in range(3)] == [(None, None)] * 3
    alone = StragglerWatch([0], ratio=1.2, window=1)
    assert alone.observe([5.0]) == (None, None)


def test_a_runs_watch_knows_each_ranks_stage_and_the_run_settings() -> None:
    """`StragglerWatch.of`: rank r's pipeline stage from the layout (dp, pp, cp outermost
    first: with pp = cp = 2 ranks 0-1 are stage 0, 2-3 stage 1, then again for dp 1)."""
    cfg = build_config({"model": {"preset": "tiny"},
                        "run": {"straggler_ratio": 1.5, "straggler_window": 4}})  # fmt: skip
    dims = ParallelDims(dp=2, pp=2, cp=2, world_size=8)
    groups = SimpleNamespace(world=SimpleNamespace(nranks=8), dims=dims)
    watch = StragglerWatch.of(cfg, groups)  # type: ignore[arg-type]
    assert watch.stages == [0, 0, 1, 1, 0, 0, 1, 1]
    assert (watch.ratio, watch.window) == (1.5, 4)
