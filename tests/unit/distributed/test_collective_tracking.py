"""No device drain per NCCL collective: hangs are caught off the hot path (issue 21 item 2).

An NCCL call returns once the collective is queued on the device. flashcp hands the task Paddle
returns to the watchdog thread, which polls `task.is_completed()` (a CUDA event query) and
expires the collective's deadline if it never completes; the training thread never calls
`paddle.device.synchronize()` for it. `FLASHCP_SYNC_COLLECTIVES=1` is the debug mode that
drains the device after each NCCL collective (`test_watchdog_nccl.py` covers that mode).

No GPU here: the NCCL side is faked. `paddle.distributed` calls return at once with a task
whose completion the test controls, and `paddle.device.synchronize` counts its calls (a fake
device module), so a training step can count its device syncs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paddle
import pytest

from flashcp.config import build_config
from flashcp.distributed import (
    Exchange,
    NamedGroup,
    all_to_all,
    collectives,
    gather_rows,
    p2p,
)
from flashcp.distributed.collectives import QUEUED_NOTE
from flashcp.distributed.watchdog import ENV_SYNC, Watchdog, sync_collectives
from flashcp.recipes.lm import LMData
from flashcp.trainer import Trainer
from helpers.fakegroups import FakeDevice, FakeNewGroup, MirrorNccl, mirror_groups


def _group(ranks: list[int] | None = None) -> NamedGroup:
    return NamedGroup("cp", 0, 3, ranks or [0, 1], pg=FakeNewGroup.PG())


OPS: dict[str, Callable[[Any], Any]] = {
    "all_gather": lambda g: collectives.all_gather_tensor(paddle.ones([2]), g, timeout=0.3),
    "all_reduce": lambda g: collectives.all_reduce_tensor(paddle.ones([2]), g, timeout=0.3),
    "broadcast": lambda g: collectives.broadcast_tensor(paddle.ones([2]), 1, g, timeout=0.3),
    "reduce_scatter[nccl]": lambda g: collectives.reduce_scatter_chunks(
        [paddle.ones([2]), paddle.ones([2])], g, timeout=0.3
    ),
    "ring_shift(shift=1)": lambda g: collectives.ring_shift(paddle.ones([2]), g, timeout=0.3),
    "send(to rank 1)": lambda g: p2p.send_tensor(paddle.ones([2]), 1, g, timeout=0.3),
    "recv(from rank 1)": lambda g: p2p.recv_tensor([2], "float32", 1, g, timeout=0.3),
    "all_to_all": lambda g: all_to_all(paddle.ones([2, 3]), [1, 1], [1, 1], Exchange(g),
                                       timeout=0.3),  # fmt: skip
    "gather_rows": lambda g: gather_rows(paddle.ones([2]), Exchange(g), root=1, timeout=0.3),
}


def _wait_for(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("op", sorted(OPS))
def test_hung_nccl_collective_returns_and_times_out_off_the_hot_path(monkeypatch, op) -> None:
    device = FakeDevice(monkeypatch)
    fake = MirrorNccl(monkeypatch, completes=False)
    start = time.monotonic()
    OPS[op](_group())  # returns at once: the collective is only queued
    assert time.monotonic() - start < 0.3 and fake.fired == []
    assert device.syncs == 0, "the collective drained the device"
    assert fake.tasks and fake.dog.pending == len(fake.tasks)
    assert _wait_for(lambda: bool(fake.fired)), "the watchdog never expired the hung collective"
    message = fake.fired[0]
    assert f"{op} on group cp[0,1] timed out after 0.3 s on rank 0" in message
    assert "rank 1 may be" in message and message.endswith(QUEUED_NOTE)
    assert device.syncs == 0


@pytest.mark.parametrize("op", sorted(OPS))
def test_completed_nccl_collective_is_dropped_without_firing(monkeypatch, op) -> None:
    """Negative control: the same calls whose device work completes never fire."""
    device = FakeDevice(monkeypatch)
    fake = MirrorNccl(monkeypatch, completes=True)
    OPS[op](_group())
    assert _wait_for(lambda: fake.dog.pending == 0)
    time.sleep(0.4)  # past the 0.3 s deadline
    assert fake.fired == [] and device.syncs == 0
    assert all(t.queries >= 1 for t in fake.tasks)


def test_gloo_calls_hand_nothing_to_the_watchdog(monkeypatch) -> None:
    """Gloo calls are synchronous on the host: nothing to track, nothing to drain."""
    device = FakeDevice(monkeypatch)
    fake = MirrorNccl(monkeypatch)
    group = NamedGroup("cp", 0, 3, [0, 1], pg=type("PG", (), {"name": lambda self: "GLOO"})())
    collectives.all_reduce_tensor(paddle.ones([2]), group, timeout=5)
    assert fake.dog.tracked == 0 and device.syncs == 0


def test_queue_is_polled_in_order_and_stops_at_the_first_pending_entry() -> None:
    """A healthy queue costs one completion check per entry; the entry not done yet stops the
    scan (later work on the same communicator cannot have finished first)."""
    fired: list[str] = []
    dog = Watchdog(on_expire=fired.append, poll_seconds=0.01)
    gate = threading.Event()
    calls = {"first": 0, "second": 0, "third": 0}

    def check(name: str, ready: Callable[[], bool]) -> Callable[[], bool]:
        def done() -> bool:
            calls[name] += 1
            return ready()

        return done

    dog.track("q", check("first", gate.is_set), 30, "first")
    dog.track("q", check("second", lambda: True), 30, "second")
    dog.track("q", check("third", lambda: True), 30, "third")
    time.sleep(0.2)  # about 20 polls
    assert calls["first"] > 1 and calls["second"] == calls["third"] == 0
    gate.set()
    assert _wait_for(lambda: dog.pending == 0)
    assert calls["second"] == calls["third"] == 1 and fired == []


def test_a_failing_completion_check_expires_the_entry() -> None:
    fired: list[str] = []
    dog = Watchdog(on_expire=fired.append, poll_seconds=0.01)

    def broken() -> bool:
        raise RuntimeError("NCCL communicator has error")

    dog.track("q", broken, 30, "all_reduce on group dp[0,1] timed out")
    assert _wait_for(lambda: bool(fired))
    assert "all_reduce on group dp[0,1]" in fired[0] and "NCCL communicator has error" in fired[0]
    assert dog.pending == 0


def test_sync_flag_values(monkeypatch) -> None:
    monkeypatch.delenv(ENV_SYNC, raising=False)
    assert sync_collectives() is False
    for value, want in (("1", True), ("true", True), ("0", False), ("off", False)):
        monkeypatch.setenv(ENV_SYNC, value)
        assert sync_collectives() is want
    monkeypatch.setenv(ENV_SYNC, "sometimes")
    with pytest.raises(ValueError, match="FLASHCP_SYNC_COLLECTIVES='sometimes'"):
        sync_collectives()


# -- a training step on mirrored NCCL groups counts its device syncs ---------------------------


LAYOUTS = {
    "replicated": ("tiny", {"dp": 2}),
    "zero1": ("tiny", {"dp": 2, "shard_optimizer": True}),
    "moe_ep2": ("tiny_glm_moe", {"dp": 2, "ep": 2}),
}
"""dp = 2 on mirrored NCCL groups: plain, ZeRO-1, and a MoE with its experts over ep = 2 (the
all-to-alls the GLM-4.5-Air recipe runs thousands of per step)."""


def _mirror_trainer(tmp: Path, layout: str) -> Trainer:
    preset, parallel = LAYOUTS[layout]
    cfg = build_config(
        {
            "model": {"preset": preset, "max_seq_len": 32},
            "data": {"seq_len": 32, "micro_batch_size": 1},
            "train": {"steps": 4, "lr": 1e-3, "warmup_steps": 1, "seed": 0, "grad_accum": 2},
            "parallel": parallel,
            "run": {"output_dir": str(tmp / "run"), "device": "cpu"},
        },
        world_size=2,
    )
    groups = mirror_groups(ep=int(parallel.get("ep", 1)))
    # this dp rank's share, indexed here (the mirrored peers would return this rank's index)
    return Trainer(cfg, groups, data=LMData(cfg, dp_rank=0, dp_size=2))


def _syncs_per_step(trainer: Trainer, device: FakeDevice, fake: MirrorNccl) -> list[tuple]:
    out = []
    for _ in range(2):
        syncs, tasks = device.syncs, len(fake.tasks)
        m = trainer.train_step()
        assert m.loss == m.loss  # finite numbers flow through the mirrored collectives
        out.append((device.syncs - syncs, len(fake.tasks) - tasks))
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_step_drains_the_device_only_in_debug_mode(tmp_path, monkeypatch, layout) -> None:
    monkeypatch.delenv(ENV_SYNC, raising=False)
    device = FakeDevice(monkeypatch)
    fake = MirrorNccl(monkeypatch)
    trainer = _mirror_trainer(tmp_path / "default", layout)
    steps = _syncs_per_step(trainer, device, fake)
    collectives_per_step = steps[0][1]
    assert collectives_per_step >= 3  # counts, gradients, step sums at least
    assert steps == [(0, collectives_per_step)] * 2, steps  # no drain; every task tracked
    assert _wait_for(lambda: fake.dog.pending == 0) and fake.fired == []

    # debug mode: the same step drains the device once per NCCL collective, as before
    monkeypatch.setenv(ENV_SYNC, "1")
    debug = _syncs_per_step(trainer, device, fake)
    assert debug == [(collectives_per_step, collectives_per_step)] * 2, debug
