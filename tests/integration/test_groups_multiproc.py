"""Real multi-process jobs (gloo on CPU): groups, exact collective results, byte counters,
the collective timeout, and the launch helper's own kill-on-timeout.

The worker (`workers/groups_worker.py`) does the exact checks itself - values of all_gather,
all_reduce, broadcast, ring_shift and both gloo reduce-scatter variants, and byte counters
against (p - 1) / p formulas - and raises on any mismatch; these tests assert that every rank
got through every group.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from flashcp.launch.supervise import LaunchResult, alive
from helpers.launch import marked_pids, run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "groups_worker.py"
FAST_FAIL = {"FLASHCP_COLLECTIVE_TIMEOUT": "60", "FLASHCP_INIT_TIMEOUT": "60"}

pytestmark = pytest.mark.integration


def _checked(result: LaunchResult, rank: int) -> set[str]:
    """Group labels rank `rank` fully checked, as `topology group` strings."""
    found = re.findall(r"^CHECKED dp=(\d) pp=(\d) cp=(\d) \(.*\) (\S+)$", result.log(rank), re.M)
    return {f"{dp}x{pp}x{cp} {label}" for dp, pp, cp, label in found}


def _assert_clean(result: LaunchResult, nproc: int) -> None:
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    for rank in range(nproc):
        assert "WORKER DONE" in result.log(rank), result.summary()
        assert "Traceback" not in result.log(rank), result.summary()


@pytest.mark.timeout(120)
def test_two_processes_cp2_collectives_exact() -> None:
    args = ["check", "--topology", "1x1x2", "--check-mode"]
    result = run_launch(WORKER, 2, args, timeout=90, env=FAST_FAIL)
    _assert_clean(result, 2)
    for rank in range(2):
        assert _checked(result, rank) == {"1x1x2 world[0,1]", "1x1x2 cp[0,1]"}
        # FLASHCP_CHECK_COLLECTIVES=1: both ranks name both calls of a diverged collective
        found = re.findall(r"^MISMATCH (.*)$", result.log(rank), re.M)
        assert len(found) == 2, result.summary()
        assert re.fullmatch(
            r"collective mismatch on cp\[0,1\] at call #3: rank 0 all_reduce float32\[3\] at "
            r"groups_worker\.py:\d+ <lambda> < .* \| rank 1 all_gather\(axis=0\) float32\[1,4\] "
            r"at groups_worker\.py:\d+ <lambda> < .*",
            found[0],
        ), found[0]
        assert re.fullmatch(
            r"collective mismatch on cp\[0,1\] at call #4: rank 0 send\(to rank 1\) "
            r"float32\[2\] at .* \| rank 1 send\(to rank 0\) float32\[2\] at .*",
            found[1],
        ), found[1]


@pytest.mark.timeout(180)
def test_four_processes_subgroups_on_dedicated_stores() -> None:
    topologies = ["1x2x2", "2x1x2", "1x1x4"]
    args = ["check"] + [a for t in topologies for a in ("--topology", t)]
    result = run_launch(WORKER, 4, args, timeout=150, env=FAST_FAIL)
    _assert_clean(result, 4)
    expected = {
        0: {"1x2x2 pp[0,2]", "1x2x2 cp[0,1]", "2x1x2 dp[0,2]", "2x1x2 cp[0,1]"},
        1: {"1x2x2 pp[1,3]", "1x2x2 cp[0,1]", "2x1x2 dp[1,3]", "2x1x2 cp[0,1]"},
        2: {"1x2x2 pp[0,2]", "1x2x2 cp[2,3]", "2x1x2 dp[0,2]", "2x1x2 cp[2,3]"},
        3: {"1x2x2 pp[1,3]", "1x2x2 cp[2,3]", "2x1x2 dp[1,3]", "2x1x2 cp[2,3]"},
    }
    for rank, groups in expected.items():
        world = {f"{t} world[0,1,2,3]" for t in topologies} | {"1x1x4 cp[0,1,2,3]"}
        assert _checked(result, rank) == groups | world, result.summary()


@pytest.mark.timeout(120)
def test_three_processes_odd_ring_collectives_exact() -> None:
    """An odd gloo ring (cp=3): gloo pairs a send with the receive of the same per-group tag,
    which an odd cycle of send/recv pairs cannot give (it timed out); ring_shift goes through
    all_gather and the reduce-scatter through all-reduce there, with exact values."""
    result = run_launch(WORKER, 3, ["check", "--topology", "1x1x3"], timeout=90, env=FAST_FAIL)
    _assert_clean(result, 3)
    for rank in range(3):
        assert _checked(result, rank) == {"1x1x3 world[0,1,2]", "1x1x3 cp[0,1,2]"}


@pytest.mark.timeout(120)
def test_collective_timeout_names_group_and_ends_job() -> None:
    """Rank 1 skips an all_gather and hangs: rank 0 must exit non-zero after ~3 s with a
    message naming the collective, the group and the missing peer; nothing may survive."""
    result = run_launch(WORKER, 2, ["timeout", "--skip-rank", "1", "--timeout", "3"], timeout=90)
    assert not result.timed_out, result.summary()
    assert result.returncode != 0, result.summary()
    assert (
        "[flashcp] all_gather on group world[0,1] timed out after 3 s on rank 0: "
        "rank 1 may be dead, hung or skipped this collective"
    ) in result.log(0), result.summary()
    assert "code 124" in result.launcher_output, result.summary()
    assert result.duration < 60, result.summary()  # the peer hangs 120 s unless torn down
    assert result.leftover == [], result.summary()


@pytest.mark.timeout(90)
def test_run_launch_kills_a_hung_job_on_timeout() -> None:
    """Both ranks wait far longer than run_launch's timeout: every process must be killed."""
    start = time.monotonic()
    result = run_launch(WORKER, 2, ["timeout", "--skip-rank", "1", "--timeout", "600"], timeout=8)
    assert result.timed_out and result.returncode == -9, result.summary()
    assert time.monotonic() - start < 30
    assert not [p for p in _marked_pids_for(result) if alive(p)]


def _marked_pids_for(result: LaunchResult) -> list[int]:
    env_path = result.log_dir / "backup_env.0.json"
    text = env_path.read_text() if env_path.exists() else ""
    match = re.search(r'"FLASHCP_LAUNCH_ID": "([0-9a-f]+)"', text)
    assert match, f"no launch marker recorded in {env_path}"
    return marked_pids(match.group(1))


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_nccl_groups_on_gpus() -> None:
    """Same exact checks over NCCL (new_group path, library reduce_scatter); GPU hosts only."""
    import paddle

    nproc = min(4, paddle.device.cuda.device_count())
    if nproc < 2:
        pytest.skip("needs at least 2 GPUs")
    topology = "1x2x2" if nproc == 4 else "1x1x2"
    result = run_launch(
        WORKER, nproc, ["check", "--topology", topology], timeout=150, env=FAST_FAIL
    )
    _assert_clean(result, nproc)
    assert "(nccl)" in result.log(0), result.summary()
