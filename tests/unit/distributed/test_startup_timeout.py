"""Start-up collectives wait the start-up timeout, not the per-step one (issue 21 item 7).

On 16 nodes every rank reads its share of the weights from shared storage, and the ranks finish
at different times: a collective right after the build (the LoRA target check, the pp names
gather, the run info) could wait longer than `FLASHCP_COLLECTIVE_TIMEOUT` for the slowest rank
and the watchdog would stop the fast ones. The trainer's build and resume run inside
`startup_phase()`, where a collective without an explicit timeout waits
`FLASHCP_STARTUP_TIMEOUT`, and the ranks meet at a world barrier right after the model is built.
The multi-process check (a rank that builds slower than the collective timeout) is
`tests/integration/test_startup_multiproc.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flashcp.config import build_config
from flashcp.distributed import (
    ENV_STARTUP_TIMEOUT,
    ENV_TIMEOUT,
    collectives,
    p2p,
    resolve_timeout,
    startup_phase,
)
from flashcp.distributed.watchdog import Watchdog
from flashcp.recipes.lm import LMData
from flashcp.trainer import Trainer
from helpers.fakegroups import MirrorNccl, mirror_groups


def test_startup_phase_sets_the_default_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "11")
    monkeypatch.setenv(ENV_STARTUP_TIMEOUT, "777")
    monkeypatch.setenv("FLASHCP_INIT_TIMEOUT", "40")
    assert resolve_timeout() == 11.0
    with startup_phase() as seconds:
        assert seconds == 777.0 and resolve_timeout() == 777.0
        assert resolve_timeout(5) == 5.0  # an explicit timeout wins
        assert resolve_timeout(init=True) == 40.0  # group creation keeps its own
        with startup_phase():
            assert resolve_timeout() == 777.0
        assert resolve_timeout() == 777.0  # still inside the outer phase
    assert resolve_timeout() == 11.0  # and back after it
    assert resolve_timeout(startup=True) == 777.0


def test_startup_phase_ends_on_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "11")
    with pytest.raises(RuntimeError), startup_phase():
        raise RuntimeError("build failed")
    assert resolve_timeout() == 11.0


def test_bad_startup_timeout_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STARTUP_TIMEOUT, "an hour")
    bad = "FLASHCP_STARTUP_TIMEOUT='an hour' is not a number"
    with pytest.raises(ValueError, match=bad), startup_phase():
        pass
    monkeypatch.setenv(ENV_STARTUP_TIMEOUT, "-3")
    with pytest.raises(ValueError, match="FLASHCP_STARTUP_TIMEOUT='-3' must be > 0"):
        resolve_timeout(startup=True)


class RecordingWatchdog(Watchdog):
    """Records every armed deadline (seconds, message) in order."""

    def __init__(self) -> None:
        super().__init__(on_expire=lambda message: None, poll_seconds=0.01)
        self.armed: list[tuple[float, str]] = []

    def arm(self, seconds: float, message: Any) -> int:
        """Record the deadline with its text (collectives pass a function that builds it)."""
        self.armed.append((seconds, message if isinstance(message, str) else message()))
        return super().arm(seconds, message)


def _op(message: str) -> str:
    """`all_reduce` of "[flashcp] all_reduce on group dp[0,1] timed out after ...""."""
    return message.removeprefix("[flashcp] ").split(" on group ")[0]


def test_every_collective_before_the_first_step_waits_the_startup_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dp = 2 job on (mirrored, faked) NCCL groups: every watched call from the build to the
    first step arms the start-up timeout, the barrier after the model build among them; the
    step's own collectives arm the collective timeout."""
    monkeypatch.setenv(ENV_TIMEOUT, "11")
    monkeypatch.setenv(ENV_STARTUP_TIMEOUT, "777")
    MirrorNccl(monkeypatch)
    dog = RecordingWatchdog()
    monkeypatch.setattr(collectives, "WATCHDOG", dog)
    monkeypatch.setattr(p2p, "WATCHDOG", dog)
    built: list[int] = []

    def factory(cfg: Any, stage: Any) -> Any:
        from flashcp.parallelize import default_model_factory

        built.append(len(dog.armed))  # what was armed before the model existed
        return default_model_factory(cfg, stage)

    cfg = build_config(
        {
            "model": {"preset": "tiny", "max_seq_len": 32},
            "data": {"seq_len": 32, "micro_batch_size": 1},
            "train": {"steps": 1, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
            "parallel": {"dp": 2, "shard_optimizer": True},
            "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
            "checkpoint": {"save_last": False},  # one process plays both ranks: no save
        },
        world_size=2,
    )
    data = LMData(cfg, dp_rank=0, dp_size=2)
    trainer = Trainer(cfg, mirror_groups(), model_factory=factory, data=data)
    first_step = []
    original = trainer.train_step

    def step() -> Any:
        first_step.append(len(dog.armed))
        return original()

    monkeypatch.setattr(trainer, "train_step", step)
    trainer.fit()
    startup, steps = dog.armed[: first_step[0]], dog.armed[first_step[0] :]
    ops = [_op(m) for _, m in startup]
    assert ops[built[0]] == "barrier after building the model", ops
    assert "barrier after resuming" in ops and "all_gather_object" in ops, ops
    assert {s for s, _ in startup} == {777.0}, startup
    assert steps and {s for s, _ in steps} == {11.0}, steps  # negative control: the step's own
    assert resolve_timeout() == 11.0  # the phase ended with the build / resume
