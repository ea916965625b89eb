"""The job's preflight (`flashcp.launch.preflight`): the master port, the launch command that
carries it, the output directory check."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flashcp.launch import job, preflight


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
