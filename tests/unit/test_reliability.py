"""The reliability pieces in one process: fault specs and hooks, torn checkpoint writes, the
per-rank exit line, the job's preflight, and how a failed job's logs are diagnosed."""

from __future__ import annotations

import io
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

import flashcp.distributed
from flashcp import faults
from flashcp.checkpoint import format as ck
from flashcp.faults import Fault
from flashcp.launch import job, outcome, preflight, worker
from helpers.paths import CONFIGS

# -- fault specs and hooks --------------------------------------------------------------------


def test_parse_faults() -> None:
    assert faults.parse_faults(None) == [] and faults.parse_faults("  ") == []
    got = faults.parse_faults("nan_loss@step3:rank1, sigkill@step2 ,nan_grad@step10:rank0")
    assert got == [Fault("nan_loss", 3, 1), Fault("sigkill", 2, None), Fault("nan_grad", 10, 0)]
    assert got[1].hits(2, 5) and not got[0].hits(3, 0) and not got[0].hits(4, 1)
    for bad, match in [
        ("nan_loss", "cannot parse"),
        ("nan_loss@3", "cannot parse"),
        ("boom@step1", "unknown fault kind 'boom'"),
        ("nan_loss@step0", "steps count from 1"),
    ]:
        with pytest.raises(faults.FaultSpecError, match=match):
            faults.parse_faults(bad)


def _trainer(rank: int = 1) -> SimpleNamespace:
    paddle.seed(0)
    model = paddle.nn.Linear(3, 2)
    return SimpleNamespace(model=model, step=0, rank=rank, params=list(model.named_parameters()))


def test_install_nothing_without_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_FAULT, raising=False)
    t = _trainer()
    assert faults.install(t) == []
    assert faults.install(t, [Fault("nan_loss", 1, 0)]) == []  # another rank's fault


def test_nan_and_inf_loss_hit_only_their_step(capsys: pytest.CaptureFixture[str]) -> None:
    t = _trainer(rank=1)
    installed = faults.install(t, [Fault("nan_loss", 2, 1), Fault("inf_loss", 3, None)])
    assert len(installed) == 2
    x = paddle.ones([4, 3])
    assert np.isfinite(t.model(x).numpy()).all()  # step 1
    t.step = 1
    assert np.isnan(t.model(x).numpy()).all()  # step 2
    t.model(x)  # announced once per fault
    t.step = 2
    assert not np.isfinite(t.model(x).numpy()).any()  # step 3: inf (or nan where 0 * inf)
    t.step = 3
    assert np.isfinite(t.model(x).numpy()).all()
    err = capsys.readouterr().err
    assert err.count("[flashcp fault] rank 1 step 2: nan_loss") == 1
    assert "step 3: inf_loss" in err


def test_nan_grad_poisons_one_gradient() -> None:
    t = _trainer(rank=0)
    faults.install(t, [Fault("nan_grad", 1, 0)])
    t.model(paddle.ones([2, 3])).sum().backward()
    first, second = (p for _, p in t.params)
    assert np.isnan(first.grad.numpy()).all() and np.isfinite(second.grad.numpy()).all()
    t.model.clear_gradients()
    t.step = 1
    t.model(paddle.ones([2, 3])).sum().backward()
    assert np.isfinite(first.grad.numpy()).all()
    with pytest.raises(faults.FaultSpecError, match="trainable parameter"):
        faults.install(SimpleNamespace(model=t.model, step=0, rank=0, params=[]),
                       [Fault("nan_grad", 1, None)])  # fmt: skip


class _KilledError(Exception):
    pass


def _no_kill() -> None:
    raise _KilledError


def test_sigkill_fault_kills_after_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_kill_self", _no_kill)
    t = _trainer(rank=2)
    faults.install(t, [Fault("sigkill", 2, 2)])
    t.model(paddle.ones([1, 3]))
    t.step = 1
    with pytest.raises(_KilledError):
        t.model(paddle.ones([1, 3]))


def _save(root: Path, step: int) -> Path:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * step}
    return ck.save_checkpoint(root, step, model=arrays, optimizer=arrays, state={"x": 1})


def test_torn_checkpoint_write_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "_kill_self", _no_kill)
    monkeypatch.setenv(faults.ENV_FAULT, "crash_in_checkpoint_write@step4")
    _save(tmp_path, 2)  # not the faulty step
    with pytest.raises(_KilledError):
        _save(tmp_path, 4)
    assert sorted(p.name for p in (tmp_path / "step_4.tmp").iterdir()) == [ck.MODEL_FILE]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2]
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_2"
    monkeypatch.delenv(faults.ENV_FAULT)
    assert _save(tmp_path, 4) == tmp_path / "step_4"  # a retry replaces the torn .tmp
    assert ck.verify_checkpoint(tmp_path / "step_4") == []


def test_fault_spec_check_is_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_FAULT, raising=False)
    faults.on_checkpoint_write(1, Path("."))  # no env: nothing parsed, nothing raised
    monkeypatch.setenv(faults.ENV_FAULT, "nan_loss@step1")
    faults.on_checkpoint_write(1, Path("."))  # other kinds: no effect here


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


# -- preflight --------------------------------------------------------------------------------


def test_master_port() -> None:
    assert preflight.master_port({}) is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.listen(1)
        with pytest.raises(preflight.PreflightError, match="is already in use"):
            preflight.master_port({preflight.ENV_MASTER_PORT: str(port)})
    assert preflight.master_port({preflight.ENV_MASTER_PORT: f" {port} "}) == port  # free again
    with pytest.raises(preflight.PreflightError, match="not a port number"):
        preflight.master_port({preflight.ENV_MASTER_PORT: "0"})


def test_launch_command_with_master_port(tmp_path: Path) -> None:
    cmd = job.launch_command("c.yaml", ["a=1"], 2, tmp_path, 29500)
    assert cmd[cmd.index("--master") + 1] == "127.0.0.1:29500"
    assert "--master" not in job.launch_command("c.yaml", [], 2, tmp_path)


def test_check_output_dir(tmp_path: Path) -> None:
    logs = preflight.check_output_dir(tmp_path / "a" / "b")
    assert logs == tmp_path / "a" / "b" / "logs" and logs.is_dir()
    assert list(logs.iterdir()) == []  # the write probe is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(preflight.PreflightError, match="not a writable directory: Not a directory"):
        preflight.check_output_dir(tmp_path / "f")


# -- diagnosing a failed job ------------------------------------------------------------------

TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
PEER = TRACEBACK + (
    "OSError: (External)\n    RuntimeError: [pair.cc:576] Read error [127.0.0.1]:5021: "
    "Connection reset by peer\n[flashcp] rank 0 exit 1\n"
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
    job.pump(io.StringIO("".join(lines)), log, out)
    assert log.getvalue() == "".join(lines)
    assert out.getvalue() == "step 1/2 | loss 5.5\n"


def test_poison_reaches_tensors_inside_containers() -> None:
    x, ids = paddle.ones([2]), paddle.to_tensor([1], dtype="int64")
    out = faults._poison((x, [x], {"h": x}, ids), float("nan"))
    assert np.isnan(out[0].numpy()).all() and np.isnan(out[1][0].numpy()).all()
    assert np.isnan(out[2]["h"].numpy()).all() and out[3].numpy().tolist() == [1]
