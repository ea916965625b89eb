"""How a job ends (`flashcp.launch.outcome`, the rank entry's exit line, the launcher's output):
every rank prints its exit line, and a failed job's logs are diagnosed naming the dead rank."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import flashcp.distributed
from flashcp.launch import console, outcome, worker
from helpers.paths import CONFIGS

# -- the per-rank exit line -------------------------------------------------------------------


def test_exit_line_is_printed_for_every_outcome(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(CONFIGS / "gpt" / "tiny_cp2.yaml")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    assert worker.run(["--config", config]) == 2
    assert capsys.readouterr().out.splitlines()[-1] == "[flashcp] rank 0 exit 2"
    with pytest.raises(SystemExit):
        worker.run([])  # argparse: --config is required
    assert "[flashcp] rank 0 exit 2" in capsys.readouterr().out

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("init failed")

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setattr(flashcp.distributed, "init_distributed", boom)
    with pytest.raises(RuntimeError, match="init failed"):
        worker.run(["--config", config])
    assert "[flashcp] rank 0 exit 1" in capsys.readouterr().out


# -- diagnosing a failed job ------------------------------------------------------------------

TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
PEER = TRACEBACK + (
    "OSError: (External)\n    RuntimeError: [pair.cc:576] Read error [127.0.0.1]:5021: "
    "Connection reset by peer\n[flashcp] rank 0 exit 1\n"
)
BACKWARD = (
    "OSError: (External) \n{\n    ====== Error message in backward of GradNodePyLayer_Attn"
    "(0x55) ======\n    CollectiveMismatchError: collective mismatch on cp[0,1] at call #75\n"
    "    \n    At:\n      x.py(8): backward\n}\n"
)
SIGTERM = (
    "FatalError: `Termination signal` is detected by the operating system.\n"
    "  [SignalInfo: *** SIGTERM (@0x2800) received by PID 10252 (TID 0x7f) from PID 10240 ***]\n"
)


@pytest.mark.parametrize(
    ("log", "code", "kind", "needle"),
    [
        (None, None, "unknown", "wrote no log"),
        ("step 1\n[flashcp] rank 0 exit 0\n", None, "finished", "finished"),
        ("[rank 1] error: non-finite loss at step 3\n[flashcp] rank 1 exit 3\n", None, "error",
         "exited with code 3: [rank 1] error: non-finite loss at step 3"),
        (TRACEBACK + "ValueError: bad thing\n", 1, "error", "raised an exception: ValueError"),
        # raised inside a backward node: Paddle's OSError wraps it, the rank names the inner one
        (TRACEBACK + BACKWARD, 1, "error", "exception: CollectiveMismatchError: collective"),
        (PEER + SIGTERM, None, "peer", "Connection reset by peer"),
        (TRACEBACK + "RuntimeError: [pair.cc:584] TIMEOUT self_rank = 1 pair_rank = 0\n", None,
         "peer", "TIMEOUT self_rank"),
        ("I1129 connected\n" + SIGTERM, None, "stopped", "stopped by the launcher"),
        ("I1129 connected\n", None, "killed", "out-of-memory killer"),
        ("I1129 connected\n", -9, "killed", "exit code -9: SIGKILL"),
        ("I1129 connected\n", -99, "killed", "exit code -99: signal 99"),
        ("I1129 connected\n", 7, "error", "exited with code 7 without an error"),
        ("[flashcp] all_gather on group cp[0,1] timed out after 5 s on rank 0: rank 1 may be "
         "dead\n", None, "timeout", "watchdog: [flashcp] all_gather"),
        ("[SignalInfo: *** SIGSEGV (@0x0) received by PID 1 (TID 0x1) from PID 0 ***]\n", None,
         "signal", "crashed with SIGSEGV"),
        ("[flashcp] rank 0 exit 0\nuv__finish_close: Assertion `0' failed.\n", None, "signal",
         "after finishing its work"),
    ],
)  # fmt: skip
def test_classify_rank(log: str | None, code: int | None, kind: str, needle: str) -> None:
    got = outcome.classify_rank(0, log, code)
    assert got.kind == kind and needle in got.text, got


def test_failure_report_blames_the_dead_rank(tmp_path: Path) -> None:
    logs = {0: PEER + SIGTERM, 1: "I1129 connected\n[flashcp fault] rank 1 step 3: sigkill\n"}
    launcher = "Container rank 1 status failed cmd ['python'] code -9 log /x/workerlog.1\n"
    assert outcome.launcher_codes(launcher) == {1: -9}
    assert [o.rank for o in outcome.diagnose(logs, launcher)] == [1, 0]
    report = outcome.failure_report(241, logs, launcher, tmp_path)
    lines = report.splitlines()
    assert lines[0] == ("flashcp: the job failed (exit 241): rank 1 died without writing an "
                        "error (the launcher saw exit code -9: SIGKILL)")  # fmt: skip
    assert lines[1].startswith("flashcp:   rank 0 lost its connection to a peer (RuntimeError")
    assert lines[2] == f"flashcp: last lines of rank 1's log ({tmp_path / 'workerlog.1'}):"
    assert lines[-1] == "    [flashcp fault] rank 1 step 3: sigkill"
    same = {r: f"[rank {r}] error: NaN at step 3\n[flashcp] rank {r} exit 3\n" for r in (0, 1)}
    report = outcome.failure_report(3, same, "", tmp_path)
    assert report.splitlines() == [
        "flashcp: the job failed (exit 3): rank 0 exited with code 3: [rank 0] error: NaN at "
        "step 3",
        "flashcp:   rank 1 the same",
    ]
    assert outcome.failure_report(1, {}, "", tmp_path) == "flashcp: the job failed (exit 1)"


def test_job_code_is_the_blamed_ranks_own_code() -> None:
    refused = "[rank {r}] error: checkpoint is broken\n[flashcp] rank {r} exit 4\n"
    # both ranks refused; the launcher stopped rank 0 on its way out and reported the signal
    logs = {0: refused.format(r=0) + SIGTERM, 1: refused.format(r=1)}
    launcher = "Container rank 0 status failed cmd ['python'] code -15 log /x/workerlog.0\n"
    assert outcome.job_code(241, outcome.diagnose(logs, launcher)) == 4
    # rank 0 stopped before it wrote its own exit: rank 1's code is still the job's
    logs[0] = "I1129 connected\n" + SIGTERM
    assert outcome.job_code(241, outcome.diagnose(logs, launcher)) == 4
    # negative controls: a killed rank or an exception without an exit line keeps the launcher's
    killed = {0: "I1129 connected\n", 1: refused.format(r=1)}
    assert outcome.job_code(241, outcome.diagnose(killed, "")) == 241
    raised = {0: TRACEBACK + "ValueError: bad\n", 1: "I1129 connected\n" + SIGTERM}
    assert outcome.job_code(1, outcome.diagnose(raised, "")) == 1
    assert outcome.job_code(0, []) == 0


def test_rank_logs_are_read_from_the_launch_offset(tmp_path: Path) -> None:
    (tmp_path / "workerlog.0").write_text("old run\n")
    offsets = outcome.log_sizes(tmp_path, 2)
    assert offsets == {0: 8, 1: 0}
    with open(tmp_path / "workerlog.0", "a") as f:
        f.write("new run\n")
    assert outcome.read_rank_logs(tmp_path, offsets) == {0: "new run\n", 1: None}


def test_pump_hides_banner_exit_lines_and_the_launchers_repeat() -> None:
    lines = [
        "LAUNCH INFO 2026 banner\n",
        "step 1/2 | loss 5.5\n",
        "[flashcp] rank 0 exit 3\n",
        "I1129 19:06:13.369 tcp_store.cc:336] server\n",
        "LAUNCH ERROR 2026 Container failed !!!\n",
        "step 1/2 | loss 5.5\n",
    ]
    log, out = io.StringIO(), io.StringIO()
    console.pump(io.StringIO("".join(lines)), log, out)
    assert log.getvalue() == "".join(lines)
    assert out.getvalue() == "step 1/2 | loss 5.5\n"


# -- after the first failure: stopped ranks, hangs, and whether a relaunch helps -------------

WATCHDOG = ("[flashcp] all_gather on group cp[0,1] timed out after 15 s on rank 1: rank 0 may be "
            "dead, hung or skipped this collective\n")  # fmt: skip


def test_a_rank_that_noted_the_launchers_sigterm_was_stopped_not_killed() -> None:
    """A rank takes SIGTERM for a pre-emption, so the launcher's stop ends it only with the
    SIGKILL after it; the line it logs on the signal tells it from a rank killed without a word."""
    noted = "I1129 connected\n" + outcome.SIGNAL_NOTED.format(rank=0, signum=15) + "\n"
    logs = {0: noted, 1: TRACEBACK + "ValueError: bad\n[flashcp] rank 1 exit 1\n"}
    first, other = outcome.diagnose(logs, "")
    assert (first.rank, first.kind) == (1, "error")
    assert (other.rank, other.kind) == (0, "stopped")
    # negative control: without the line the silent rank is the one killed, and blamed
    logs[0] = "I1129 connected\n"
    assert [(o.rank, o.kind) for o in outcome.diagnose(logs, "")] == [(0, "killed"), (1, "error")]


def test_a_killed_rank_stays_blamed_whichever_rank_the_launcher_names() -> None:
    """Paddle's launcher names the lowest failed rank it sees, not the first: rank 0 lost its
    peer (exit 1) before the launcher noticed rank 2's SIGKILL. Rank 2 is still to blame."""
    logs = {0: PEER, 1: PEER.replace("rank 0", "rank 1"), 2: "I1129 connected\n"}
    launcher = "Container rank 0 status failed cmd ['python'] code 1 log /x/workerlog.0\n"
    blamed = outcome.diagnose(logs, launcher)[0]
    assert (blamed.rank, blamed.kind) == (2, "killed")


def test_the_rank_that_never_reached_a_timed_out_collective_hung() -> None:
    logs = {0: "I1129 connected\n[flashcp fault] rank 0 step 5: hang\n", 1: WATCHDOG}
    launcher = "Container rank 1 status failed cmd ['python'] code 124 log /x/workerlog.1\n"
    outcomes = outcome.diagnose(logs, launcher)
    assert [(o.rank, o.kind) for o in outcomes] == [(0, "hung"), (1, "timeout")]
    v = outcome.verdict(247, outcomes, rank_offset=2)
    assert (v.cause, v.rank, v.code, v.final) == ("hang", 2, 247, None)
    assert "did not reach the collective rank 1 timed out in" in v.text


@pytest.mark.parametrize(
    ("code", "final"),
    [
        (outcome.EXIT_CONFIG, "a refused config"),
        (outcome.EXIT_NONFINITE, "a non-finite loss"),
        (outcome.EXIT_CHECKPOINT, "a broken checkpoint"),
        (outcome.EXIT_DATA, "bad data"),
        (outcome.EXIT_PREEMPTED, "a pre-emption"),
        (1, None),
    ],
)
def test_a_ranks_own_exit_code_decides_whether_a_relaunch_helps(
    code: int, final: str | None
) -> None:
    logs = {r: f"[rank {r}] error: x\n[flashcp] rank {r} exit {code}\n" for r in (0, 1)}
    v = outcome.verdict(code, outcome.diagnose(logs, ""))
    assert (v.code, v.cause, v.rank, v.final) == (code, "error", 0, final)


def test_verdict_without_any_rank_log() -> None:
    v = outcome.verdict(-9, [])
    assert (v.code, v.cause, v.rank) == (-9, "unknown", None)


def test_the_exit_codes_are_one_table() -> None:
    """docs/training.md's table is `EXIT_CODES`, row for row; every `EXIT_*` constant is in it;
    `flashcp.cli` and its `flashcp.commands` return no literal exit code (issue 38, item 2)."""
    import ast
    import re

    from flashcp import cli
    from flashcp.launch import outcome
    from helpers.paths import ROOT

    text = (ROOT / "docs" / "training.md").read_text().split("# Exit codes", 1)[1]
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", text, re.M)[1:])
    rows.pop("---", None)
    assert rows == outcome.EXIT_CODES
    constants = {v for k, v in vars(outcome).items()
                 if k.startswith("EXIT_") and isinstance(v, int)}  # fmt: skip
    assert {str(c) for c in constants if c != outcome.EXIT_SIGNAL_BASE} <= set(outcome.EXIT_CODES)
    commands = Path(cli.__file__).parent / "commands"
    for path in [Path(cli.__file__), *sorted(commands.glob("*.py"))]:
        tree = ast.parse(path.read_text())
        literal = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Return)
                   and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)]
        assert literal == [], f"{path.name} returns literal exit codes at lines {literal}"
