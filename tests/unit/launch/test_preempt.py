"""A pre-emption signal in a rank (`flashcp.launch.preempt`): it only notes the first signal,
which the trainer exchanges with the other ranks at the step's end."""

from __future__ import annotations

import os
import signal
import time

import pytest

from flashcp.launch import outcome, preempt


def test_the_signals_are_sigterm_and_the_configured_one() -> None:
    assert preempt.preempt_signals(None) == (signal.SIGTERM,)
    assert preempt.preempt_signals("SIGUSR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert preempt.preempt_signals("SIGTERM") == (signal.SIGTERM,)
    with pytest.raises(KeyError):
        preempt.preempt_signals("SIGNOPE")


def _wait(stop: preempt.StopSignals) -> int:
    deadline = time.monotonic() + 5
    while not stop() and time.monotonic() < deadline:
        time.sleep(0.01)
    return stop()


def test_a_signal_is_noted_and_the_process_keeps_running(
    capfd: pytest.CaptureFixture[str],
) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    stop = preempt.StopSignals(preempt.preempt_signals("SIGUSR2"), rank=3).install()
    try:
        assert stop() == 0 and stop.received is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert _wait(stop) == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)  # the first one stays the one noted
        time.sleep(0.05)
        assert stop() == signal.SIGUSR2 and stop.received is not None
        assert stop.received.name == "SIGUSR2" and stop.received.at > 0
        err, deadline = "", time.monotonic() + 5  # logged by the pipe's reader thread
        while "got signal 15" not in err and time.monotonic() < deadline:
            err += capfd.readouterr().err
            time.sleep(0.01)
        assert f"[flashcp] rank 3 got signal {int(signal.SIGUSR2)}: it stops after" in err
        assert outcome.SIGNAL_NOTED_RE.search(err)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup pipe is gone too



def test_uninstall_puts_back_the_default_where_python_had_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler installed outside Python (Paddle's) reads as None: SIGTERM then ends the rank
    at once again, as the launcher's stop expects during teardown."""
    set_to: list[object] = []
    real = signal.signal

    def record(sig: int, handler: object) -> object:
        set_to.append(handler)
        return None if len(set_to) == 1 else real(sig, handler)  # type: ignore[arg-type]

    monkeypatch.setattr(preempt.signal, "signal", record)
    stop = preempt.StopSignals().install()
    stop.uninstall()
    assert set_to[-1] == signal.SIG_DFL
    real(signal.SIGTERM, signal.SIG_DFL)
