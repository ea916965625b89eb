"""Leased rendezvous ports (`flashcp.distributed.ports`): outside the ephemeral range, free when
leased, exclusive between processes until released, and what `flashcp train` hands the launcher.

The failure they prevent (seen in CI): Paddle's launcher picked a master port in the kernel's
ephemeral range, another process bound it before rank 0 did, and Paddle's libuv TCPStore
aborted rank 0 (SIGABRT) at process-group creation.
"""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashcp.config import load_config
from flashcp.distributed import ports
from flashcp.launch import job, preflight
from helpers.paths import CONFIGS

CONFIG = CONFIGS / "gpt" / "tiny_cp2.yaml"


def _run_job(out: Path, printed: io.StringIO) -> int:
    """`flashcp train CONFIG run.output_dir=OUT`'s launch, from its loaded config."""
    args = [f"run.output_dir={out}"]
    return job.run_job(load_config(CONFIG, args), CONFIG, args, out=printed)


def _other_process_reserves(directory: Path, window: tuple[int, int], hold: bool = False) -> str:
    """What `reserve(1)` in a separate process says for `window` (the lock directory shared)."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from flashcp.distributed import ports
        try:
            lease = ports.reserve(1, window={window!r}, directory=Path({str(directory)!r}))
        except RuntimeError as exc:
            print("refused:", exc)
        else:
            print("leased", lease.first, flush=True)
            if {hold!r}:
                os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lock
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip()


def test_window_avoids_the_ephemeral_range() -> None:
    assert ports.rendezvous_window((32768, 60999)) == (20000, 32767)
    assert ports.rendezvous_window((40000, 65535)) == (20000, 39999)
    assert ports.rendezvous_window((10000, 30000)) == (30001, 65535)
    with pytest.raises(RuntimeError, match=r"ephemeral port range 1024-65535 .*sysctl"):
        ports.rendezvous_window((1024, 65535))


def test_ephemeral_range_is_read_or_defaulted(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("1025\t40000\n")
    bad.write_text("not numbers\n")
    assert ports.ephemeral_range(good) == (1025, 40000)
    assert ports.ephemeral_range(bad) == ports.DEFAULT_EPHEMERAL
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL


def test_lease_is_consecutive_free_and_outside_the_ephemeral_range(tmp_path: Path) -> None:
    low, high = ports.ephemeral_range()
    with ports.reserve(4, directory=tmp_path) as lease:
        assert list(lease.ports) == list(range(lease.first, lease.first + 4))
        assert all(not low <= p <= high for p in lease.ports)
        assert all(ports.probe(p) for p in lease.ports)  # leased, not bound: the job binds them
        assert lease.env() == {"PORT_RANGE": f"{lease.first}:{lease.first + 3}"}


def test_leases_exclude_each_other_until_released(tmp_path: Path) -> None:
    held = ports.reserve(2, directory=tmp_path)
    window = (held.first, held.last)
    with pytest.raises(RuntimeError, match=rf"no 1 consecutive free ports in {held.first}-"):
        ports.reserve(1, window=window, directory=tmp_path)  # same process, other open file
    assert _other_process_reserves(tmp_path, window).startswith("refused: no 1 consecutive")
    held.release()
    assert _other_process_reserves(tmp_path, window).startswith("leased ")


def test_a_dead_holders_lease_is_free_again(tmp_path: Path) -> None:
    probe = ports.reserve(1, directory=tmp_path)
    window = (probe.first, probe.first)
    probe.release()
    assert _other_process_reserves(tmp_path, window, hold=True) == f"leased {probe.first}"
    with ports.reserve(1, window=window, directory=tmp_path) as again:  # killed: lock gone
        assert again.first == probe.first


def test_a_bound_port_is_skipped(tmp_path: Path) -> None:
    first = ports.reserve(2, directory=tmp_path)
    first.release()
    with socket.socket() as busy:
        busy.bind(("", first.first))
        busy.listen()
        with ports.reserve(1, window=(first.first, first.last), directory=tmp_path) as lease:
            assert lease.first == first.last
        with pytest.raises(RuntimeError, match="free ports"):
            ports.reserve(1, window=(first.first, first.first), directory=tmp_path)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"count=0\): count must be at least 1"):
        ports.reserve(0)
    with pytest.raises(ValueError, match="too small"):
        ports.reserve(3, window=(20000, 20001))


def _launch_prints_port_range(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = [sys.executable, "-c", "import os; print('PORT_RANGE=' + os.environ['PORT_RANGE'])"]
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: cmd)
    monkeypatch.delenv(preflight.ENV_MASTER_PORT, raising=False)
    monkeypatch.delenv("FLAGS_flash_attn_version", raising=False)


def test_flashcp_train_hands_the_launcher_a_lease_and_frees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _launch_prints_port_range(monkeypatch)
    monkeypatch.delenv("PORT_RANGE", raising=False)
    printed = io.StringIO()
    code = _run_job(tmp_path / "run", printed)
    assert code == 0, printed.getvalue()
    (line,) = [x for x in printed.getvalue().splitlines() if x.startswith("PORT_RANGE=")]
    first, last = (int(x) for x in line.removeprefix("PORT_RANGE=").split(":"))
    assert last - first + 1 == 2 + 2  # the store, 2 endpoints, a spare
    low, high = ports.ephemeral_range()
    assert last < low or first > high
    with ports.reserve(4, window=(first, last)) as again:  # released when the job ended
        assert again.first == first


def test_flashcp_train_keeps_a_users_port_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _launch_prints_port_range(monkeypatch)
    monkeypatch.setenv("PORT_RANGE", "41000:41099")
    printed = io.StringIO()
    assert _run_job(tmp_path / "run", printed) == 0
    assert "PORT_RANGE=41000:41099" in printed.getvalue().splitlines()


def test_no_free_ports_is_a_preflight_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(job, "launch_command", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.delenv("PORT_RANGE", raising=False)

    def exhausted(count: int) -> ports.PortLease:
        raise RuntimeError(f"no {count} consecutive free ports in 20000-32767 after 200 tries")

    monkeypatch.setattr(ports, "reserve", exhausted)
    out = tmp_path / "run"
    assert _run_job(out, io.StringIO()) == 2
    assert capsys.readouterr().err.strip() == (
        "flashcp: cannot launch: PORT_RANGE: no 4 consecutive free ports in 20000-32767 after "
        "200 tries"
    )
    assert not out.exists()
