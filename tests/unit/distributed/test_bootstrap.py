"""Bootstrap in one process (`flashcp.distributed.bootstrap`): the master endpoint's precedence,
the launcher's environment, a one-process init with its groups."""

from __future__ import annotations

import pytest

from flashcp.distributed import (
    ParallelDims,
    build_groups,
    init_distributed,
    launch_env,
    master_endpoint,
    shutdown,
)


def test_master_endpoint_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT", "PADDLE_MASTER", "PADDLE_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(key, raising=False)
    assert master_endpoint() is None
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6000,10.0.0.2:6000")
    assert master_endpoint() == "10.0.0.1:6000"
    monkeypatch.setenv("PADDLE_MASTER", "127.0.0.1:5000")
    assert master_endpoint() == "127.0.0.1:5000"
    monkeypatch.setenv("MASTER_ADDR", "host")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert master_endpoint() == "host:1234"


def test_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "2")
    env = launch_env()
    assert (env.rank, env.world_size, env.is_distributed) == (2, 4, True)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "4")
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        launch_env()
    monkeypatch.setenv("PADDLE_TRAINER_ID", "x")
    with pytest.raises(ValueError, match="PADDLE_TRAINER_ID='x' is not an integer"):
        launch_env()


def test_single_process_bootstrap_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.initialized) == (0, 1, False)
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
    assert [groups[d].label for d in ("world", "dp", "pp", "cp")] == [
        "world[0]",
        "dp[0]",
        "pp[0]",
        "cp[0]",
    ]
    assert groups.backend == "none" and all(groups[d].is_trivial for d in ("dp", "pp", "cp"))
    with pytest.raises(KeyError):
        groups["tp"]
    with pytest.raises(
        ValueError, match=r"ParallelDims is for 2 ranks .*init_distributed\(\) first"
    ):
        build_groups(ParallelDims(dp=1, pp=1, cp=2, world_size=2))
    shutdown()
