"""The host plan's checkpoint copies (`flashcp.plan.host`): a synchronous save holds one file's
copy at a time, in its own moment; an asynchronous one (`checkpoint.async`) holds the model and
optimizer copies together while training goes on, so they count in the training step."""

from __future__ import annotations

import pytest

from flashcp.plan import plan
from flashcp.plan.features import Features
from flashcp.plan.host import HOST_PROCESS_BYTES
from flashcp.plan.params import stage_parameters
from helpers.configs import PLANNED, Sections, TinyCfg, merged


@pytest.fixture
def tiny_base() -> Sections:
    return merged(PLANNED, model={"recompute": "full"}, parallel={"cp": 2}, checkpoint={"every": 5})


def test_async_checkpoints_hold_both_copies_during_the_training_step(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg()
    params = sum(x.numel for x in stage_parameters(cfg.model)) * 4  # float32 parameters
    moments = 2 * params  # Paddle's AdamW moments, written by the stage writer
    sync = plan(cfg, device="gpu").host
    assert sync is not None
    writer = sync.ranks[0]
    assert writer.moments["checkpoint save"]["checkpoint_arrays"] == max(params, moments)
    assert writer.moments["training step"]["checkpoint_arrays"] == 0
    held = plan(tiny_cfg(checkpoint={"every": 5, "async": True}), device="gpu").host
    assert held is not None
    writer, other = held.ranks
    assert set(writer.moments) == {"training step"}  # no separate save moment
    assert writer.moments["training step"]["checkpoint_arrays"] == params + moments
    assert other.moments["training step"]["checkpoint_arrays"] == 0  # it writes nothing
    assert writer.moment == "training step"
    assert writer.total_bytes == params + moments + HOST_PROCESS_BYTES
    assert held.peak.total_bytes > sync.peak.total_bytes


def test_async_copies_add_to_offloaded_activations(tiny_cfg: TinyCfg) -> None:
    """Both live in host memory at once: the copies are held across the next steps, whose
    offload moves activations out too."""
    offload = Features(offload_activations=True)
    sync = plan(tiny_cfg(), features=offload).host
    held = plan(tiny_cfg(checkpoint={"every": 5, "async": True}), features=offload).host
    assert sync is not None and held is not None
    before, after = sync.ranks[0].moments["training step"], held.ranks[0].moments["training step"]
    assert before["offloaded_activations"] == after["offloaded_activations"] > 0
    assert after["checkpoint_arrays"] > 0 == before["checkpoint_arrays"]


def test_no_checkpoints_no_copies(tiny_cfg: TinyCfg) -> None:
    host = plan(tiny_cfg(checkpoint={"every": 0, "async": True}), device="gpu").host
    assert host is not None
    assert all(r.moments["training step"]["checkpoint_arrays"] == 0 for r in host.ranks)
