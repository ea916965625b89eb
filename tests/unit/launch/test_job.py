"""`flashcp.launch` in one process: the config is loaded once per launch, the package sits above
the trainer (nothing below imports it), the supervisor stops a whole process tree, and the rank
entry (not the `Trainer`) sets the runtime flags."""

from __future__ import annotations

import ast
import io
import json
import os
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import flashcp.config.load
from flashcp import cli, fa_dispatch, runlock
from flashcp.config import load_config
from flashcp.launch import console, job, launcher, lifeline, preflight, supervise, worker
from helpers.paths import ROOT

SRC = ROOT / "src" / "flashcp"
CONFIG = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"


# -- one config load per launch ---------------------------------------------------------------


@pytest.fixture
def yaml_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of a YAML config in this process (`load_config` reads through `read_yaml`)."""
    reads: list[str] = []
    original = flashcp.config.load.read_yaml

    def counted(path: Any) -> Any:
        reads.append(str(path))
        return original(path)

    monkeypatch.setattr(flashcp.config.load, "read_yaml", counted)
    return reads


def test_flashcp_train_loads_the_config_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, yaml_reads: list[str]
) -> None:
    """The CLI loads it; preflight and the launch command use that `Config` (the ranks, other
    processes, each load their own copy). Before: 3 loads in this process."""
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: [sys.executable, "-c", "pass"])
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)
    monkeypatch.delenv(fa_dispatch.FLAG_VERSION, raising=False)
    assert cli.main(["train", str(CONFIG), f"run.output_dir={tmp_path / 'run'}"]) == 0
    assert yaml_reads == [str(CONFIG)]
    yaml_reads.clear()
    refused = ["hardware.memory_gib=0.001", f"run.output_dir={tmp_path / 'small'}"]
    assert cli.main(["train", str(CONFIG), *refused]) == preflight.EXIT_PREFLIGHT
    assert yaml_reads == [str(CONFIG)]


def test_run_job_launches_the_ranks_with_the_file_and_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[Any, ...]] = []

    def command(*args: Any) -> list[str]:
        seen.append(args)
        return [sys.executable, "-c", "pass"]

    original = job.launch_command
    monkeypatch.setattr(job, "launch_command", command)
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)
    overrides = ["train.steps=3", f"run.output_dir={tmp_path / 'run'}"]
    assert job.run_job(load_config(CONFIG, overrides), CONFIG, overrides, out=io.StringIO()) == 0
    ((config, passed, nproc, log_dir, _port, _nodes, evaluate),) = seen
    assert (config, passed, nproc, log_dir) == (CONFIG, overrides, 2, tmp_path / "run" / "logs")
    assert not evaluate
    # `flashcp eval`: the ranks evaluate (`--eval`), logs apart, and a run directory training
    # would refuse (a fresh run over checkpoints) is not refused: nothing of it is written
    (tmp_path / "run" / "checkpoints" / "step_2").mkdir(parents=True)
    fresh = [*overrides, "checkpoint.resume=never"]
    assert job.run_job(load_config(CONFIG, fresh), CONFIG, fresh, out=io.StringIO()) == 2
    seen.clear()
    assert job.run_job(load_config(CONFIG, fresh), CONFIG, fresh, out=io.StringIO(),
                       evaluate=True) == 0  # fmt: skip
    ((_, _, _, log_dir, _, _, evaluate),) = seen
    assert evaluate and log_dir == tmp_path / "run" / "logs" / "eval"
    cmd = original(CONFIG, ["a=1"], 2, log_dir, None, None, True)
    assert cmd[cmd.index("--config") + 1 :] == [str(CONFIG), "--eval", "a=1"]


# -- layers -----------------------------------------------------------------------------------


def _flashcp_imports(path: Path) -> set[str]:
    """The `flashcp...` modules `path` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("flashcp")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashcp"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {str(node.module)}
    return found


def test_nothing_below_launch_imports_it() -> None:
    """`launch` imports the trainer (downward); only the command line and the launcher's
    script import `launch` (the command line: `cli.py` and its handlers in `commands/`), so no
    module below can form a cycle with it."""
    above = {SRC / "cli.py", SRC / "train.py"}
    importers = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p not in above
        and SRC / "launch" not in p.parents
        and SRC / "commands" not in p.parents
        and any(m.startswith("flashcp.launch") for m in _flashcp_imports(p))
    )
    assert importers == []


def test_the_launchers_script_imports_only_the_rank_entry() -> None:
    """The rank entry, and before it the tie to the launcher (`lifeline`: it imports nothing
    of flashcp or Paddle, so a rank ties itself before its seconds of imports)."""
    assert _flashcp_imports(SRC / "train.py") == {
        "flashcp.launch.lifeline",
        "flashcp.launch.lifeline.hold",
        "flashcp.launch.worker",
        "flashcp.launch.worker.run",
    }
    assert _flashcp_imports(SRC / "launch" / "lifeline.py") == set()
    assert launcher.train_script() == (SRC / "train.py").resolve()


def test_supervisor_and_outcomes_know_no_training() -> None:
    """`supervise` and `outcome` are process and text plumbing: no config, trainer, model (the
    log files' names from `flashcp.rundir`, which imports nothing; the watchdog's exit code)."""
    for name in ("supervise.py", "outcome.py"):
        imported = _flashcp_imports(SRC / "launch" / name)
        plumbing = ("flashcp.distributed.ports", "flashcp.distributed.watchdog", "flashcp.rundir")
        assert {m for m in imported if not m.startswith(plumbing)} <= {
            "flashcp.distributed", "flashcp.launch", "flashcp.launch.lifeline",
            "flashcp.distributed.watchdog",  # the hang's exit code (process plumbing, no Paddle)
            "flashcp.distributed.watchdog.TIMEOUT_EXIT_CODE",
        }, (name, imported)


# -- stopping a process tree ------------------------------------------------------------------

TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    # a child in a session of its own, as Paddle's launcher starts its workers
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                     start_new_session=True)
    time.sleep(600)
    """
)


def _gone(pids: list[int], within: float = 30.0) -> bool:
    """Whether every pid stops running within `within` s: a killed process is gone once the
    kernel has run it again (under load, or in uninterruptible sleep while its interpreter
    pages in, that can outlast the kill's grace)."""
    deadline = time.monotonic() + within
    while any(supervise.alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_timed_out_tree_is_stopped_whole() -> None:
    marker = uuid.uuid4().hex
    tree = supervise.Job.start([sys.executable, "-c", TREE], supervise.job_env(marker))
    deadline = time.monotonic() + 30
    while len(supervise.marked_pids(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = supervise.marked_pids(marker)
    assert len(pids) == 2 and tree.proc.pid in pids
    started = time.monotonic()
    code, timed_out, _ = tree.wait(0.5)
    assert (code, timed_out) == (-9, True)
    assert time.monotonic() - started < 10
    assert _gone(pids)
    assert tree.leftover(0.1) == []


def test_leftover_kills_what_outlives_the_root() -> None:
    marker = uuid.uuid4().hex
    env = supervise.job_env(marker, marker_env="FLASHCP_TEST_MARK")
    orphan = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', " \
             "'import time; time.sleep(600)'], start_new_session=True)"  # fmt: skip
    root = supervise.Job.start([sys.executable, "-c", orphan], env, marker_env="FLASHCP_TEST_MARK")
    assert root.wait(30)[:2] == (0, False)
    left = root.leftover(0.2)
    assert len(left) == 1 and _gone(left)
    assert _gone(supervise.marked_pids(marker, "FLASHCP_TEST_MARK"))


def test_job_env_drops_a_surrounding_jobs_identity() -> None:
    base = {"PADDLE_TRAINER_ID": "3", "MASTER_ADDR": "h", "PADDLE_NNODES": "2", "HOME": "/h"}
    env = supervise.job_env("m", base=base)
    assert env == {"PADDLE_NNODES": "2", "HOME": "/h", supervise.JOB_MARKER: "m",
                   "PYTHONUNBUFFERED": "1"}  # fmt: skip
    assert "PADDLE_NNODES" not in supervise.job_env("m", base=base, drop=("PADDLE_", "MASTER_"))


# -- runtime flags ----------------------------------------------------------------------------


@pytest.mark.usefixtures("isolated_environ")
def test_the_rank_entry_sets_deterministic_mode_for_the_dispatch() -> None:
    for name in worker.DETERMINISTIC_FLAGS:
        os.environ.pop(name, None)
    assert fa_dispatch.probe_deterministic()[0] is False
    worker.set_runtime_flags(load_config(CONFIG, ["train.deterministic=false"]))
    assert fa_dispatch.probe_deterministic()[0] is False
    worker.set_runtime_flags(load_config(CONFIG))  # train.deterministic: true
    assert fa_dispatch.probe_deterministic()[0] is True
    assert all(os.environ[name] == "1" for name in worker.DETERMINISTIC_FLAGS)


# -- one job per run directory ----------------------------------------------------------------


def test_a_second_job_on_a_run_directory_in_use_is_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flashcp train` and `flashcp eval` on a directory another job holds: exit 2, one line
    naming the holder, nothing launched; once it is free, the job holds the lock while it runs
    (its ranks get the token and its PID) and removes it at the end."""
    seen: list[dict[str, str]] = []
    dump = tmp_path / "env.json"
    write = f"import json, os; json.dump(dict(os.environ), open({str(dump)!r}, 'w'))"
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: [sys.executable, "-c", write])
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)
    out = tmp_path / "run"
    other = runlock.acquire(out, runlock.Holder("flashcp train", 4321, command="flashcp train x"))
    try:
        for evaluate in (False, True):
            args = [f"run.output_dir={out}", "eval.path=null"]
            code = job.run_job(load_config(CONFIG, args), CONFIG, args, out=io.StringIO(),
                               evaluate=evaluate)  # fmt: skip
            err = capsys.readouterr().err
            assert code == 2 and not dump.exists(), err
            assert err.count("\n") == 1 and err.startswith(
                f"flashcp: cannot launch: run.output_dir: {out} is in use by flashcp train "
                "(pid 4321 on "
            ), err
            assert "`flashcp train x`): wait for that job to end or stop it (kill 4321" in err
    finally:
        other.release()
    args = [f"run.output_dir={out}"]
    printed = io.StringIO()
    assert job.run_job(load_config(CONFIG, args), CONFIG, args, out=printed) == 0
    seen.append(json.loads(dump.read_text()))
    assert seen[0][lifeline.ENV_OWNER_PID] == str(os.getpid())
    token = seen[0][runlock.ENV_TOKEN]
    assert len(token) == 32 and seen[0][lifeline.ENV_LAUNCHER_PID]  # started tethered
    assert not (out / runlock.LOCK_FILE).exists()  # released at the end
    assert printed.getvalue().endswith("flashcp: finished; no step saved; exit 0\n")


def test_the_launch_holds_the_lock_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in launcher reads the lock while it runs: the job's own token is in it."""
    dump = tmp_path / "lock.json"
    out = tmp_path / "run"
    read = f"import shutil; shutil.copy({str(out / runlock.LOCK_FILE)!r}, {str(dump)!r})"
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: [sys.executable, "-c", read])
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)
    args = [f"run.output_dir={out}"]
    assert job.run_job(load_config(CONFIG, args), CONFIG, args, out=io.StringIO(),
                       command="flashcp train c.yaml") == 0  # fmt: skip
    held = json.loads(dump.read_text())
    assert (held["what"], held["pid"], held["command"]) == (
        "flashcp train", os.getpid(), "flashcp train c.yaml",
    )  # fmt: skip


def test_rank_zero_lines_the_launcher_did_not_echo_are_found(tmp_path: Path) -> None:
    """The launcher echoed rank 0's first lines among its own; the rest is what it never did."""
    log = tmp_path / "workerlog.0"
    log.write_text("earlier run\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("step 1\nstep 2\nsaved checkpoint x/step_2\n[flashcp] rank 0 exit 75\nlast")
    echo = console.RankZeroEcho(log, offset)
    for line in ("LAUNCH INFO banner\n", "step 1\n", "I1202 glog\n", "step 2\n"):
        echo.saw(line)
    assert echo.rest() == ["saved checkpoint x/step_2\n", "[flashcp] rank 0 exit 75\n", "last\n"]
    missing = console.RankZeroEcho(tmp_path / "workerlog.9", 0)
    missing.saw("step 1\n")
    assert missing.rest() == []
