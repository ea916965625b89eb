"""`flashcp.runlock`: one job per run directory. A second holder is refused in one line naming
the holder and the ways out; a lock left by a job that is gone is taken over with a note (same
machine: at once; `flock` unsupported: by PID; another host: past the heartbeat timeout); ranks
of one job started directly share it; the holder removes it when it ends. The launched checks
(a second `flashcp train`, ranks started directly, a SIGKILLed holder) are in
`tests/integration/test_faults.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashcp import rundir, runlock, runstart
from flashcp.runlock import LOCK_FILE, Holder, RunLockError


def _holder(**kw: object) -> Holder:
    return Holder(**{"what": "flashcp train", "pid": os.getpid(), "command": "flashcp train c.yaml",
                     **kw})  # type: ignore[arg-type]  # fmt: skip


def test_a_second_holder_is_refused_naming_the_first_and_the_ways_out(tmp_path: Path) -> None:
    first = runlock.acquire(tmp_path / "run", _holder())
    assert first.note is None
    recorded = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert (recorded["what"], recorded["pid"], recorded["token"]) == (
        "flashcp train", os.getpid(), first.token,
    )  # fmt: skip
    with pytest.raises(RunLockError) as refused:
        runlock.acquire(tmp_path / "run", _holder(), retry_s=0.1)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"run.output_dir: {tmp_path / 'run'} is in use by flashcp train "
                              f"(pid {os.getpid()} on ")  # fmt: skip
    assert "`flashcp train c.yaml`" in message
    assert message.endswith(f"wait for that job to end or stop it (kill {os.getpid()}; run the "
                            "same command again to resume it), or choose another run.output_dir")
    with pytest.raises(RunLockError):  # the check that creates nothing says the same
        runlock.probe(tmp_path / "run")
    first.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # the holder removes it
    runlock.probe(tmp_path / "run")
    again = runlock.acquire(tmp_path / "run", _holder())
    assert again.note is None  # nothing to take over: it was released
    again.release()


HOLD = textwrap.dedent(
    """
    import os, sys, time
    from flashcp import runlock
    held = runlock.acquire(sys.argv[1], runlock.Holder("flashcp train", os.getpid()))
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_lock_whose_holder_was_killed_is_taken_over_with_a_note(tmp_path: Path) -> None:
    """SIGKILL leaves the file, but the kernel drops the holder's `flock` at once."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(RunLockError, match=f"in use by flashcp train \\(pid {proc.pid} "):
            runlock.acquire(tmp_path, _holder(), retry_s=0.1)
    finally:
        proc.kill()
        proc.wait()
    assert (tmp_path / LOCK_FILE).exists()  # left behind
    held = runlock.acquire(tmp_path, _holder())
    assert held.note is not None and held.note.startswith(
        f"run.output_dir {tmp_path} was locked by flashcp train (pid {proc.pid} on "
    )
    assert held.note.endswith(f"which is gone (pid {proc.pid} no longer runs): taken over")
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == held.token
    held.release()


def _plant(where: Path, holder: Holder, age_s: float) -> None:
    where.mkdir(parents=True, exist_ok=True)
    path = where / LOCK_FILE
    path.write_text(holder.to_json())
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_another_hosts_lock_counts_until_its_heartbeat_is_older_than_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that may not share our `flock` (a network file system): its record's heartbeat
    decides, `FLASHCP_LOCK_STALE_S`."""
    monkeypatch.setenv(runlock.ENV_STALE_S, "60")
    other = _holder(host="node-b", boot="another-kernel", pid=4242)
    _plant(tmp_path, other, age_s=5)
    with pytest.raises(RunLockError) as refused:
        runlock.acquire(tmp_path, _holder())
    assert "in use by flashcp train (pid 4242 on node-b" in str(refused.value)
    assert "(kill 4242 on node-b;" in str(refused.value)
    assert str(refused.value).endswith(
        "a lock whose heartbeat stopped is taken over after FLASHCP_LOCK_STALE_S 60 s"
    )
    _plant(tmp_path, other, age_s=61)
    held = runlock.acquire(tmp_path, _holder())
    assert held.note is not None and "whose heartbeat stopped 61 s ago (more than " \
        "FLASHCP_LOCK_STALE_S 60 s): taken over" in held.note  # fmt: skip
    held.release()


def test_without_flock_a_holder_on_this_host_is_judged_by_its_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runlock, "_flock", lambda fd, how: "unsupported")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _plant(tmp_path, _holder(pid=sleeper.pid), age_s=0)
        with pytest.raises(RunLockError, match=f"pid {sleeper.pid} on "):
            runlock.acquire(tmp_path, _holder())
    finally:
        sleeper.kill()
        sleeper.wait()
    held = runlock.acquire(tmp_path, _holder())
    assert held.note is not None and f"which is gone (pid {sleeper.pid} does not run)" in held.note
    held.release()


def test_the_holder_refreshes_its_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    held = runlock.acquire(tmp_path, _holder())
    old = time.time() - 1000
    os.utime(tmp_path / LOCK_FILE, (old, old))
    deadline = time.monotonic() + 10
    while (tmp_path / LOCK_FILE).stat().st_mtime < old + 500 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tmp_path / LOCK_FILE).stat().st_mtime > old + 500
    held.release()


def test_ranks_of_one_direct_launch_share_the_lock_and_another_launch_is_refused(
    tmp_path: Path,
) -> None:
    env = {"PADDLE_MASTER": "127.0.0.1:6170", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2"}
    token = runlock.paddle_token(env)
    assert token is not None and token == runlock.paddle_token(dict(env))
    assert runlock.paddle_token({**env, "PADDLE_TRAINER_ENDPOINTS": "a:3,a:4"}) != token
    assert runlock.paddle_token({}) is None
    first = runlock.join(tmp_path, _holder(what="paddle.distributed.launch", token=token))
    assert first is not None  # the first rank to come holds it
    assert runlock.join(tmp_path, _holder(what="paddle.distributed.launch", token=token)) is None
    other = runlock.paddle_token({**env, "PADDLE_TRAINER_ENDPOINTS": "a:3,a:4"})
    with pytest.raises(RunLockError, match="in use by paddle.distributed.launch"):
        runlock.join(tmp_path, _holder(what="paddle.distributed.launch", token=other))
    # ranks under `flashcp train` check its token
    runlock.check_token(tmp_path, token)
    with pytest.raises(RunLockError, match="in use by paddle.distributed.launch"):
        runlock.check_token(tmp_path, "not-this-job")
    first.release()
    with pytest.raises(RunLockError, match="is not locked by this rank's job"):
        runlock.check_token(tmp_path, token)


def test_a_held_lock_whose_record_is_not_written_yet_is_waited_for(tmp_path: Path) -> None:
    """A peer rank took the `flock` and has not written the record yet: `join` waits for it —
    its own job's record: shared; none within the limit: refused, naming no holder."""
    import fcntl

    path = tmp_path / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    naps: list[float] = []
    try:
        with pytest.raises(RunLockError, match="held and names no holder yet"):
            # longer than one `acquire`'s own retries of the flock (RETRY_S)
            runlock.join(tmp_path, _holder(token="t"), wait_s=runlock.RETRY_S + 0.5,
                         sleep=naps.append)  # fmt: skip
        assert naps  # it waited

        def written(_: float) -> None:  # the peer writes its record while this rank waits
            os.pwrite(fd, _holder(token="t").to_json().encode(), 0)

        assert runlock.join(tmp_path, _holder(token="t"), wait_s=30, sleep=written) is None
    finally:
        os.close(fd)


def test_a_directory_holding_only_the_lock_and_logs_is_no_earlier_run(tmp_path: Path) -> None:
    held = runlock.acquire(tmp_path, _holder())
    (tmp_path / rundir.LOG_DIR).mkdir()
    assert runstart.earlier_run(tmp_path) == []
    assert runstart.start_problems(tmp_path, "never", overwrite=True) == []
    held.release()


def test_a_run_moved_aside_takes_its_lock_file_along_and_the_release_removes_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    held = runlock.acquire(out, _holder())
    (out / "metrics.jsonl").write_text("{}\n")
    moved = runstart.move_aside(out)
    assert moved is not None and (moved / LOCK_FILE).exists()
    held.release(moved_to=moved)
    assert not (moved / LOCK_FILE).exists() and (moved / "metrics.jsonl").exists()


def test_stale_seconds_reads_the_environment() -> None:
    assert runlock.stale_seconds({}) == runlock.STALE_S
    assert runlock.stale_seconds({runlock.ENV_STALE_S: "30"}) == 30.0
    assert runlock.stale_seconds({runlock.ENV_STALE_S: "soon"}) == runlock.STALE_S
    assert runlock.stale_seconds({runlock.ENV_STALE_S: "-1"}) == runlock.STALE_S

