"""`flashcp train`'s restart loop and pre-emption in one process, over a stand-in launcher
(`job.launch_command` patched): a script that plays one launch per attempt — a killed rank, a
rank's own exit code, a pre-emption — and writes the logs Paddle's launcher would. The real
launched jobs are `tests/integration/test_faults.py`."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flashcp import rundir
from flashcp.config import load_config
from flashcp.launch import job, launcher, outcome, preflight, restart
from flashcp.launch.nodesync import NodeSync
from flashcp.launch.signals import Signals
from helpers.paths import ROOT

CONFIG = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"

FAKE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    log_dir, seen, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    n = int(os.environ.get("FLASHCP_ATTEMPT", "0"))
    with open(seen, "a") as f:
        f.write(json.dumps({"attempt": n, "argv": sys.argv[5:]}) + "\\n")
    what = plan[min(n, len(plan) - 1)]
    def log(rank, text):
        with open(os.path.join(log_dir, f"workerlog.{rank}"), "a") as f:
            f.write(text)
    if what == "ok":
        for r in (0, 1):
            log(r, f"[flashcp] rank {r} exit 0\\n")
        sys.exit(0)
    if what == "kill":
        log(0, "[flashcp fault] rank 0 step 3: sigkill\\n")
        log(1, "I1202 connected\\n")
        print("Container rank 0 status failed cmd ['python'] code -9 log x", flush=True)
        sys.exit(1)
    if what.startswith("exit"):
        code = int(what[4:])
        for r in (0, 1):
            log(r, f"[rank {r}] error: stop\\n[flashcp] rank {r} exit {code}\\n")
        sys.exit(code)
    if what == "preempt":  # the ranks save and stop when the signal reaches them
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        signal.signal(signal.SIGINT, lambda s, f: got.append(s))  # it must never come here
        open(seen + ".started", "w").close()
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        code = 75 if got == [signal.SIGTERM] else 9
        if code == 75:  # step 3 saved (a complete checkpoint: its directory and manifest)
            step = os.path.join(os.path.dirname(log_dir), "checkpoints", "step_3")
            os.makedirs(step)
            open(os.path.join(step, "manifest.json"), "w").close()
            log(0, f"saved checkpoint {step}\\n")  # never echoed by this launcher
        for r in (0, 1):
            log(r, f"[flashcp] rank {r} exit {code}\\n")
        sys.exit(code)
    if what == "die":  # the launcher itself killed from outside
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`fake(plan)`: every launch runs the stand-in with `plan` (one action per attempt);
    returns where it records the attempt number and overrides each launch saw."""
    script = tmp_path / "fake_launcher.py"
    script.write_text(FAKE)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)

    def use(plan: list[str]) -> Path:
        def command(config: Any, overrides: list[str], nproc: int, log_dir: Path,
                    *_: Any) -> list[str]:  # fmt: skip
            # the train script among the arguments: the stand-in is a "rank" to signal
            return [sys.executable, str(script), str(log_dir), str(seen), json.dumps(plan),
                    str(launcher.train_script()), *overrides]  # fmt: skip

        monkeypatch.setattr(job, "launch_command", command)
        return seen

    return use


def _run(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    args = [f"run.output_dir={tmp_path / 'run'}", "run.restart_backoff_s=0", *overrides]
    printed = io.StringIO()
    code = job.run_job(load_config(CONFIG, args), CONFIG, args, out=printed)
    return code, printed.getvalue()


def _seen(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_rank_is_relaunched_from_the_latest_checkpoint(tmp_path: Path, fake: Any) -> None:
    seen = fake(["kill", "kill", "ok"])
    (tmp_path / "run" / "checkpoints" / "step_4").mkdir(parents=True)  # a complete one
    code, out = _run(tmp_path, "run.max_restarts=3")
    assert code == 0, out
    launches = _seen(seen)
    assert [s["attempt"] for s in launches] == [0, 1, 2]
    resume = f"checkpoint.resume={json.dumps(str(tmp_path / 'run' / 'checkpoints' / 'step_4'))}"
    assert launches[0]["argv"][-1] == "run.max_restarts=3"  # the command's own alone
    assert launches[1]["argv"][-2:] == ["run.overwrite=false", resume]
    records = rundir.restart_records(tmp_path / "run")
    assert [(r["restart"], r["cause"], r["rank"], r["resume_step"]) for r in records] == [
        (1, "killed", 0, 4), (2, "killed", 0, 4),
    ]  # fmt: skip
    assert "restart 1 of 3 (run.max_restarts) after killed of rank 0" in out
    assert "launching 2 process(es) (restart 2)" in out
    # what the launcher wrote is named in flashcp.rundir
    assert {p.name for p in (tmp_path / "run").iterdir()} <= set(rundir.ENTRIES)
    assert {p.name for p in (tmp_path / "run" / rundir.LOG_DIR).iterdir()} >= {
        rundir.LAUNCHER_LOG}


def test_no_restart_without_budget_or_after_a_final_exit(tmp_path: Path, fake: Any) -> None:
    seen = fake(["kill", "ok"])
    code, out = _run(tmp_path)  # run.max_restarts: 0 by default
    assert code != 0 and "not restarting: run.max_restarts is 0" in out
    assert [s["attempt"] for s in _seen(seen)] == [0]
    seen.unlink()
    fake(["exit3", "ok"])
    code, out = _run(tmp_path, "run.max_restarts=5")
    assert code == outcome.EXIT_NONFINITE
    assert "not restarting: a non-finite loss (exit 3) is not fixed by a relaunch" in out
    assert [s["attempt"] for s in _seen(seen)] == [0]
    assert rundir.restart_records(tmp_path / "run") == []


@pytest.mark.parametrize(
    ("signum", "code", "told", "how"),
    [
        (signal.SIGTERM, outcome.EXIT_PREEMPTED,
         "flashcp: pre-emption (SIGTERM): passed on to 1 rank(s); they finish the step",
         "flashcp: pre-empted (SIGTERM): every rank saved and stopped"),
        (signal.SIGINT, 130,
         "flashcp: Ctrl-C: passed on to 1 rank(s) as SIGTERM; they finish the step, save and "
         "stop (run.preempt_grace_s 120 s; Ctrl-C again stops them at once)",
         "flashcp: stopped by Ctrl-C (SIGINT): every rank saved and stopped"),
    ],
)  # fmt: skip
def test_a_sigterm_or_ctrl_c_to_flashcp_train_is_passed_on_and_the_ranks_save(
    tmp_path: Path, fake: Any, signum: int, code: int, told: str, how: str
) -> None:
    """The ranks get SIGTERM (for Ctrl-C too), save step 3 and stop; rank 0's last line,
    which the launcher never echoed, reaches the console, then the line that says how the
    job ended, the step saved and the exit code."""
    seen = fake(["preempt"])
    started = Path(str(seen) + ".started")

    def signal_when_started() -> None:
        deadline = time.monotonic() + 20
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    before = signal.getsignal(signum)
    sender = threading.Thread(target=signal_when_started)
    sender.start()
    got, out = _run(tmp_path, "run.max_restarts=3")
    sender.join()
    assert got == code, out
    assert told in out
    step = tmp_path / "run" / "checkpoints" / "step_3"
    assert out.endswith(f"saved checkpoint {step}\n{how}; saved step 3 ({step}); run the same "
                        f"command again to resume from it; exit {code}\n"), out
    assert "the job failed" not in out and rundir.restart_records(tmp_path / "run") == []
    assert signal.getsignal(signum) == before  # flashcp train's handlers are gone


def test_a_killed_launcher_is_named_and_the_last_line_says_no_step_was_saved(
    tmp_path: Path, fake: Any
) -> None:
    """Paddle's launcher SIGKILLed from outside (its ranks end with it, `lifeline`): the job
    failed because of it, not a rank, and no checkpoint was written by this command."""
    fake(["die"])
    (tmp_path / "run" / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_2" / "manifest.json").write_text("{}")
    code, out = _run(tmp_path)
    assert code == 128 + signal.SIGKILL, out
    assert ("flashcp: the job failed (exit 137): Paddle's launcher was killed by SIGKILL from "
            "outside") in out  # fmt: skip
    assert "pre-empted" not in out and "rank 0 died" not in out
    step = tmp_path / "run" / "checkpoints" / "step_2"
    assert out.endswith(
        "flashcp: failed: Paddle's launcher was killed by SIGKILL; no step saved (the newest "
        f"checkpoint is step 2, {step}); run the same command again to resume from it; "
        "exit 137\n"
    ), out


# -- flashcp train's own signals; the nodes' decision -----------------------------------------


def test_signals_a_second_one_stops_and_a_sleep_ends_early() -> None:
    sig = Signals((signal.SIGTERM, signal.SIGUSR1))
    assert sig.pass_on([os.getpid()]) == []  # nothing to pass on yet
    assert sig.sleep(0.01) and sig.code == 128 + signal.SIGTERM
    sig._on(signal.SIGUSR1, None)
    assert (sig.preempting, sig.stop) == (signal.SIGUSR1, None)
    assert not sig.sleep(5.0)  # ends at once: a pre-emption came
    sig._on(signal.SIGTERM, None)  # a second one: stop now
    assert sig.stop == signal.SIGTERM and sig.code == 128 + signal.SIGTERM
    ctrl_c = Signals((signal.SIGTERM,))
    ctrl_c._on(signal.SIGINT, None)  # Ctrl-C: the ranks save and stop, on SIGTERM
    assert (ctrl_c.preempting, ctrl_c.stop, ctrl_c.code) == (signal.SIGINT, None, 130)
    assert ctrl_c.ctrl_c and ctrl_c.passed == signal.SIGTERM
    ctrl_c._on(signal.SIGINT, None)  # Ctrl-C again: at once
    assert ctrl_c.stop == signal.SIGINT and ctrl_c.code == 130


def _ended(node_logs: dict[int, str | None], output: str = "") -> launcher.Ended:
    return launcher.Ended(247, node_logs, output)


def test_every_node_takes_node_0s_decision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 saw its rank 2 killed; node 0 stopped its ranks on node 1's report: node 0 decides
    from both reports, node 1 follows — the same restart, from the same checkpoint."""
    cfg = load_config(CONFIG, [f"run.output_dir={tmp_path}", "run.max_restarts=2"])
    (tmp_path / "checkpoints" / "step_6").mkdir(parents=True)
    nodes = [preflight.Nodes(2, r, "127.0.0.1:1") for r in (0, 1)]
    syncs = [NodeSync(tmp_path, r, 2) for r in (0, 1)]
    killed = _ended({0: "I1202 connected\n", 1: "I1202 connected\n"},
                    "Container rank 0 status failed cmd ['python'] code -9 log x\n")  # fmt: skip
    theirs = restart.Report(1, 247, "killed", 2, "died", time.time(), "killed")
    elsewhere = launcher.Ended(-15, {}, "", "node 1 reports ...", theirs)
    assert job._report(elsewhere, io.StringIO(), tmp_path, 0) == 247
    got: dict[int, Any] = {}
    follower = threading.Thread(target=lambda: got.update(
        {1: job._decide(cfg, killed, 247, 0, nodes[1], 2, syncs[1], 2)}))  # fmt: skip
    follower.start()
    got[0] = job._decide(cfg, elsewhere, 247, 0, nodes[0], 2, syncs[0], 2)
    follower.join(30)
    assert got[0] == got[1]
    decision, overrides, step = got[0]
    assert decision.restart and (decision.cause, decision.node, decision.rank) == ("killed", 1, 2)
    assert step == 6 and overrides[-1].endswith('step_6"')
    # node 0 gone: node 1 stops after the rendezvous timeout, saying so
    monkeypatch.setattr(job, "rendezvous_timeout", lambda: 0.2)
    lost, more, _ = job._decide(cfg, killed, 247, 1, nodes[1], 2, syncs[1], 2)
    assert not lost.restart and lost.cause == "node lost" and "node 0 is lost" in lost.why
    assert more == []
