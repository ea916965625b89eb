"""The quick-start job (`src/flashcp/smoke.py`) on 2 gloo processes exits 0 and says OK."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashcp.smoke
from helpers.launch import run_launch

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_quickstart_job_two_processes() -> None:
    script = Path(flashcp.smoke.__file__)
    result = run_launch(script, 2, ["--seq-len", "512", "--head-dim", "32"], timeout=100)
    assert result.ok, result.summary()
    assert "OK against the single-process kernel" in result.log(0), result.summary()
    for rank in range(2):
        assert f"rank {rank}/2: tokens 256 of 512" in result.log(rank), result.summary()
        assert "Traceback" not in result.log(rank)
