"""`flashcp.launch.lifeline`: a tethered launcher ends with the process that started it, and a
rank with its launcher (and with `flashcp train`), whatever ended them — SIGKILL included —
with process trees that stand in for `flashcp train`, the launcher and a rank. The launched
check (SIGKILL of a real `flashcp train`: no process left, nothing written) is in
`tests/integration/test_faults.py`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashcp.launch import lifeline, supervise

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

SRC = str(Path(lifeline.__file__).resolve().parents[2])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLASHCP_"))}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _gone(pid: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while lifeline.pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _child_pid(proc: subprocess.Popen[str], tied: bool = False) -> int:
    """The pid the stand-in printed; with `tied`, once its child printed that it is tied."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), line
    if tied:
        assert proc.stdout.readline() == "tied\n"
    return int(line)


PARENT = textwrap.dedent(
    """
    import sys, time
    from flashcp.launch import supervise
    # a "launcher" in a session of its own, started as `flashcp train` starts it
    child = supervise.Job.start([sys.executable, "-c", "import time; time.sleep(600)"],
                                {**__import__("os").environ, "FLASHCP_JOB_ID": "t"},
                                tether=bool(int(sys.argv[1])))
    print(child.proc.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("tether", [True, False])
def test_a_tethered_launcher_ends_when_flashcp_train_is_killed(tether: bool) -> None:
    """Untethered (as before), the launcher of a SIGKILLed parent runs on: the control."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(int(tether))],
                              stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    child = _child_pid(parent)
    try:
        assert lifeline.pid_alive(child)
        parent.kill()
        parent.wait()
        assert _gone(child, within=10.0 if tether else 2.0) is tether
    finally:
        if lifeline.pid_alive(child):
            os.kill(child, signal.SIGKILL)


LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    # a "rank" in a session of its own, as Paddle's launcher starts it; it ties itself first
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(600)
    """
)
RANK = textwrap.dedent(
    """
    import os, sys, time
    from flashcp.launch import lifeline
    if os.environ.get("NO_PDEATHSIG"):  # the watchdog alone, as where no prctl exists
        lifeline.parent_death_signal = lambda sig=9: False
    lifeline.hold(poll_s=0.1)
    print("tied", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("pdeathsig", [True, False])
def test_a_rank_ends_with_its_launcher(pdeathsig: bool) -> None:
    extra = {"PADDLE_TRAINER_ID": "0"} if pdeathsig else {"PADDLE_TRAINER_ID": "0",
                                                          "NO_PDEATHSIG": "1"}  # fmt: skip
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdout=subprocess.PIPE,
                                text=True, env=_env(**extra))  # fmt: skip
    rank = _child_pid(launcher, tied=True)
    try:
        assert lifeline.pid_alive(rank)
        launcher.kill()
        launcher.wait()
        assert _gone(rank)
    finally:
        if lifeline.pid_alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_rank_ends_with_its_flashcp_train_and_a_process_without_a_launcher_is_not_tied(
) -> None:  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    extra = {"PADDLE_TRAINER_ID": "0", lifeline.ENV_OWNER_PID: str(owner.pid)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdout=subprocess.PIPE,
                                text=True, env=_env(**extra))  # fmt: skip
    rank = _child_pid(launcher, tied=True)
    try:
        owner.kill()
        owner.wait()
        assert _gone(rank)
        assert launcher.poll() is None  # only the rank watches the owner
    finally:
        launcher.kill()
        launcher.wait()
    assert lifeline.hold({}) is None  # no PADDLE_TRAINER_ID: run by hand, nothing to watch


def test_the_trampoline_starts_nothing_for_a_parent_that_is_gone() -> None:
    """Its parent died before it could tie itself: the launcher is never exec'd."""
    not_parent = os.getpid() + 1 if os.getpid() + 1 != os.getppid() else os.getpid() + 2
    done = subprocess.run([sys.executable, "-m", "flashcp.launch.lifeline", str(not_parent),
                           sys.executable, "-c", "print('started')"], capture_output=True,
                          text=True, env=_env(), timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout) == (lifeline.ORPHAN_EXIT, "")
    ok = subprocess.run(lifeline.tethered([sys.executable, "-c",
                                           "import os; print(os.environ['FLASHCP_LAUNCHER_PID'],"
                                           " os.getpid())"]),
                        capture_output=True, text=True, env=_env(), timeout=60)  # fmt: skip
    launcher_pid, pid = ok.stdout.split()
    assert ok.returncode == 0 and launcher_pid == pid  # exec'd in place, its PID recorded


def test_an_orphaned_rank_kills_itself_at_once() -> None:
    """A rank whose launcher (`FLASHCP_LAUNCHER_PID`) died before the rank could tie itself."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = _env(PADDLE_TRAINER_ID="0", **{lifeline.ENV_LAUNCHER_PID: str(dead.pid)})
    done = subprocess.run([sys.executable, "-c", RANK], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL


def test_supervise_stop_still_reaches_a_tethered_tree() -> None:
    marker = "lifeline-" + str(os.getpid())
    job = supervise.Job.start([sys.executable, "-c", "import time; time.sleep(600)"],
                              supervise.job_env(marker), tether=True)  # fmt: skip
    deadline = time.monotonic() + 20
    while not supervise.marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.proc.pid in supervise.marked_pids(marker)
    job.stop(grace=2.0)
    assert job.proc.poll() is not None and _gone(job.proc.pid)
