"""The `flashcp` CLI: explain-dispatch prints its inputs, the version and the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashcp import cli, dispatch


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (dispatch.FLAG_VERSION, dispatch.FLAG_DETERMINISTIC, dispatch.ENV_FA4_POLICY):
        monkeypatch.delenv(key, raising=False)


def test_explain_dispatch_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain-dispatch"]) == 0
    out = capsys.readouterr().out
    assert "FLAGS_flash_attn_version" in out and "(default)" in out
    assert "Effective fa_version: 2" in out
    assert "CPU reference" in out


def test_explain_dispatch_deterministic_downgrade(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(dispatch.FLAG_VERSION, "3")
    assert cli.main(["explain-dispatch", "--head-dim", "192", "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "Effective fa_version: 2" in out
    assert "head_dim <= 128" in out


def test_explain_dispatch_fa4_unavailable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(dispatch.FLAG_VERSION, "4")
    assert cli.main(["explain-dispatch"]) == 2
    assert "needs the CuTe FlashMask backend" in capsys.readouterr().out
    assert cli.main(["explain-dispatch", "--fa4-unavailable", "fallback"]) == 0
    assert "Effective fa_version: 3" in capsys.readouterr().out


def test_python_dash_m_flashcp() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flashcp", "explain-dispatch", "--head-dim", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Effective fa_version" in proc.stdout


def test_no_subcommand_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
