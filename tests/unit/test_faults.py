"""Fault injection (`flashcp.faults`) in one process: fault specs and their hooks (NaN/Inf loss,
a poisoned gradient, SIGKILL after the forward, a torn checkpoint write, a failed save's
`OSError`)."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from flashcp import attempt, faults
from flashcp.checkpoint import format as ck
from flashcp.faults import Fault
from helpers.checkpoints import save_checkpoint


def test_parse_faults() -> None:
    assert faults.parse_faults(None) == [] and faults.parse_faults("  ") == []
    got = faults.parse_faults("nan_loss@step3:rank1, sigkill@step2 ,nan_grad@step10:rank0")
    assert got == [Fault("nan_loss", 3, 1), Fault("sigkill", 2, None), Fault("nan_grad", 10, 0)]
    assert got[1].hits(2, 5) and not got[0].hits(3, 0) and not got[0].hits(4, 1)
    assert faults.parse_faults("hang@step5:rank0:attempt1,slow@step2:attempt2") == [
        Fault("hang", 5, 0, 1), Fault("slow", 2, None, 2),
    ]  # fmt: skip
    slow = Fault("slow", 3, 1)
    assert [slow.hits(s, 1) for s in (2, 3, 4, 9)] == [False, True, True, True]  # from step 3 on
    for bad, match in [
        ("nan_loss", "cannot parse"),
        ("nan_loss@3", "cannot parse"),
        ("nan_loss@step3:attempt1:rank0", "cannot parse"),  # rank before attempt
        ("boom@step1", "unknown fault kind 'boom'"),
        ("nan_loss@step0", "steps count from 1"),
    ]:
        with pytest.raises(faults.FaultSpecError, match=match):
            faults.parse_faults(bad)


def _trainer(rank: int = 1) -> SimpleNamespace:
    """A model, its parameters and a step count, as `install` takes them from a trainer."""
    paddle.seed(0)
    model = paddle.nn.Linear(3, 2)
    return SimpleNamespace(model=model, step=0, rank=rank, params=list(model.named_parameters()))


def _install(t: SimpleNamespace, given: list[Fault] | None = None) -> list[Fault]:
    return faults.install(t.model, t.params, lambda: t.step, given, rank=t.rank)


def test_install_nothing_without_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_FAULT, raising=False)
    t = _trainer()
    assert _install(t) == []
    assert _install(t, [Fault("nan_loss", 1, 0)]) == []  # another rank's fault


def test_nan_and_inf_loss_hit_only_their_step(capsys: pytest.CaptureFixture[str]) -> None:
    t = _trainer(rank=1)
    installed = _install(t, [Fault("nan_loss", 2, 1), Fault("inf_loss", 3, None)])
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
    _install(t, [Fault("nan_grad", 1, 0)])
    t.model(paddle.ones([2, 3])).sum().backward()
    first, second = (p for _, p in t.params)
    assert np.isnan(first.grad.numpy()).all() and np.isfinite(second.grad.numpy()).all()
    t.model.clear_gradients()
    t.step = 1
    t.model(paddle.ones([2, 3])).sum().backward()
    assert np.isfinite(first.grad.numpy()).all()
    with pytest.raises(faults.FaultSpecError, match="trainable parameter"):
        faults.install(t.model, [], lambda: 0, [Fault("nan_grad", 1, None)], rank=0)


class _KilledError(BaseException):
    """The stand-in for SIGKILL: like the signal, no `except Exception` in flashcp stops it."""


def _no_kill() -> None:
    raise _KilledError


def test_sigkill_fault_kills_after_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_kill_self", _no_kill)
    t = _trainer(rank=2)
    _install(t, [Fault("sigkill", 2, 2)])
    t.model(paddle.ones([1, 3]))
    t.step = 1
    with pytest.raises(_KilledError):
        t.model(paddle.ones([1, 3]))


def _save(root: Path, step: int) -> Path:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * step}
    return save_checkpoint(root, step, model=arrays, optimizer=arrays, state={"x": 1})


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


def test_poison_reaches_tensors_inside_containers() -> None:
    x, ids = paddle.ones([2]), paddle.to_tensor([1], dtype="int64")
    out = faults._poison((x, [x], {"h": x}, ids), float("nan"))
    assert np.isnan(out[0].numpy()).all() and np.isnan(out[1][0].numpy()).all()
    assert np.isnan(out[2]["h"].numpy()).all() and out[3].numpy().tolist() == [1]


@pytest.mark.parametrize(("kind", "code"), [("save_enospc", "ENOSPC"), ("save_eacces", "EACCES"),
                                            ("save_eio", "EIO")])  # fmt: skip
def test_failed_save_faults_raise_their_errno_at_their_step_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    kind: str, code: str,
) -> None:  # fmt: skip
    monkeypatch.setenv(faults.ENV_FAULT, f"{kind}@step4:rank1")
    faults.on_save_write(4, tmp_path, rank=0)  # another rank
    faults.on_save_write(3, tmp_path, rank=1)  # another step
    with pytest.raises(OSError) as raised:
        faults.on_save_write(4, tmp_path, rank=1)
    assert errno.errorcode[raised.value.errno] == code and raised.value.filename == str(tmp_path)
    assert f"[flashcp fault] rank 1 step 4: {kind} ({code} while saving" in capsys.readouterr().err
    monkeypatch.setenv(faults.ENV_FAULT, f"{kind}@step4")  # no rank: every rank's part
    with pytest.raises(OSError):
        faults.on_save_write(4, tmp_path)
    monkeypatch.delenv(faults.ENV_FAULT)
    faults.on_save_write(4, tmp_path, rank=1)  # unset: nothing


def test_a_fault_fires_in_its_launch_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relaunched job (`flashcp.attempt`) does not meet the fault that failed the launch
    before it again; `:attemptA` names a later launch."""
    monkeypatch.setenv(faults.ENV_FAULT, "sigkill@step3:rank1,hang@step5:rank0:attempt1")
    monkeypatch.delenv(attempt.ENV_ATTEMPT, raising=False)
    assert faults.active_faults() == [Fault("sigkill", 3, 1)]
    monkeypatch.setenv(attempt.ENV_ATTEMPT, "1")
    assert faults.active_faults() == [Fault("hang", 5, 0, 1)]
    monkeypatch.setenv(attempt.ENV_ATTEMPT, "2")
    assert faults.active_faults() == []


def test_slow_sleeps_every_step_from_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.ENV_SLOW, "0.05")
    t = _trainer(rank=1)
    _install(t, [Fault("slow", 2, 1)])
    for step in range(4):
        t.step = step
        t.model(paddle.ones([1, 3]))
    assert slept == [0.05, 0.05, 0.05]  # steps 2, 3, 4
    monkeypatch.setenv(faults.ENV_SLOW, "soon")
    with pytest.raises(faults.FaultSpecError, match="FLASHCP_FAULT_SLOW_S"):
        _install(_trainer(rank=1), [Fault("slow", 2, 1)])


def test_sigterm_fault_signals_once_and_hang_never_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    t = _trainer(rank=0)
    _install(t, [Fault("sigterm", 1, 0), Fault("hang", 3, 0)])
    t.model(paddle.ones([1, 3]))
    t.model(paddle.ones([1, 3]))  # same step again: not twice
    assert sent == [(os.getpid(), signal.SIGTERM)]

    class _HungError(Exception):
        pass

    def hang() -> None:
        raise _HungError

    monkeypatch.setattr(faults, "_hang", hang)
    t.step = 2
    with pytest.raises(_HungError):
        t.model(paddle.ones([1, 3]))


def test_a_hung_rank_ignores_sigterm_and_never_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[tuple[int, object]] = []
    monkeypatch.setattr(faults.signal, "signal", lambda sig, h: set_to.append((sig, h)))

    class _WokenError(Exception):
        pass

    def sleep(_seconds: float) -> None:
        raise _WokenError  # the only way out of the hang here

    monkeypatch.setattr(faults.time, "sleep", sleep)
    with pytest.raises(_WokenError):
        faults._hang()
    assert set_to == [(signal.SIGTERM, signal.SIG_IGN)]
