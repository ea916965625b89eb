"""`scripts/gpu_check.sh`: prerequisites checked up front with clear messages, and the GPU tests
run without the deterministic flags (issue 21 item 10).

* Prerequisites (exit 5, before any venv or install): bash >= 4.4
  (`FLASHCP_GPU_CHECK_BASH_VERSION` stands for an older shell), Python >= 3.10 that can create
  a venv (stub interpreters stand for an old or venv-less one), and the package indexes the
  install will read (a local HTTP server stands for a reachable index, a closed port for an
  unreachable one).
* The whole run, on a stub interpreter that plays a GPU machine's Python (it logs every call
  with the deterministic flag it saw): `pytest -m gpu tests` runs without
  FLAGS_cudnn_deterministic even when the caller exported it, then the GPU unit tests run again
  with it; the summary reports both.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PIP_INDEX_URL", "PADDLE_GPU_INDEX")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env={**base, **env}, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, check=False, cwd=ROOT,
    )  # fmt: skip


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """A local 'package index' answering for paddlepaddle-gpu and pip; yields (url, paths)."""
    root = tmp_path / "index"
    for project in ("paddlepaddle-gpu", "pip"):
        (root / project).mkdir(parents=True)
        (root / project / "index.html").write_text("<html></html>")
    seen: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            seen.append(self.path)

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", seen
    finally:
        server.shutdown()
        server.server_close()


def _stub(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


# -- bash -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "ok"), [("3.2", False), ("4.2", False), ("4.4", True),
                                             ("5.2", True)])  # fmt: skip
def test_bash_version(version: str, ok: bool) -> None:
    proc = _run("--print-plan", env={"FLASHCP_GPU_CHECK_BASH_VERSION": version,
                                     "FLASHCP_GPU_CHECK_COMPUTE_CAP": "9.0"})  # fmt: skip
    if ok:
        assert proc.returncode == 0, proc.stderr
        assert "index:" in proc.stdout
    else:
        assert proc.returncode == 5
        assert f"this is bash {version}; the script needs bash >= 4.4" in proc.stderr
        assert proc.stdout == ""  # nothing ran


# -- Python -----------------------------------------------------------------------------------


def test_missing_python(tmp_path: Path) -> None:
    proc = _run("--print-deps", env={"PYTHON": str(tmp_path / "python3.12")})
    assert proc.returncode == 5
    assert "python3.12' is not a command; set PYTHON=" in proc.stderr


def test_old_python(tmp_path: Path) -> None:
    old = _stub(tmp_path / "python3", 'echo "3.8"\n')
    proc = _run("--print-deps", env={"PYTHON": str(old)})
    assert proc.returncode == 5
    assert "is Python 3.8; flashcp needs Python >= 3.10" in proc.stderr


def test_python_without_venv(tmp_path: Path, index: tuple[str, list[str]]) -> None:
    """A venv is needed only when .venv-gpu does not exist yet; ensurepip must be there too."""
    no_venv = _stub(tmp_path / "python3", 'case "$2" in\n'
                    '  *ensurepip*) exit 1 ;;\n'
                    '  *"[:2]"*) echo 3.11 ;;\n'
                    '  *"[:3]"*) echo 3.11.4 ;;\n'
                    "esac\n")  # fmt: skip
    url, _ = index
    env = {"PYTHON": str(no_venv), "FLASHCP_GPU_VENV": str(tmp_path / "venv"),
           "PADDLE_GPU_INDEX": url, "PIP_INDEX_URL": url}  # fmt: skip
    proc = _run("--check-prereqs", env=env)
    assert proc.returncode == 5
    assert "cannot create a venv: its venv/ensurepip modules are missing" in proc.stderr
    assert "apt install python3.11-venv" in proc.stderr
    # an existing .venv-gpu needs no venv module (the stub answers the index probes too)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    _stub(tmp_path / "venv" / "bin" / "python", "")
    proc = _run("--check-prereqs", env=env)
    assert proc.returncode == 0 and "prerequisites: ok" in proc.stdout, proc.stderr


# -- package indexes --------------------------------------------------------------------------


def test_reachable_indexes_pass(tmp_path: Path, index: tuple[str, list[str]]) -> None:
    url, seen = index
    env = {"PYTHON": sys.executable, "FLASHCP_GPU_VENV": str(tmp_path / "venv"),
           "PADDLE_GPU_INDEX": url, "PIP_INDEX_URL": url}  # fmt: skip
    proc = _run("--check-prereqs", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prerequisites: ok" in proc.stdout
    assert f"Paddle's wheel index reachable: {url}" in proc.stdout
    assert f"Python package index reachable: {url}" in proc.stdout
    assert sorted(seen) == ["/paddlepaddle-gpu/", "/pip/"]
    assert not (tmp_path / "venv").exists()  # a check creates nothing


def test_unreachable_paddle_index_is_named(tmp_path: Path, index: tuple[str, list[str]]) -> None:
    url, _ = index
    dead = f"http://127.0.0.1:{_closed_port()}/cu126/"
    env = {"PYTHON": sys.executable, "FLASHCP_GPU_VENV": str(tmp_path / "venv"),
           "PADDLE_GPU_INDEX": dead, "PIP_INDEX_URL": url}  # fmt: skip
    proc = _run("--check-prereqs", env=env)
    assert proc.returncode == 5
    assert f"cannot reach the package index {dead} (" in proc.stderr
    assert "set PADDLE_GPU_INDEX, or give the wheels" in proc.stderr


def test_unreachable_pypi_is_named(tmp_path: Path, index: tuple[str, list[str]]) -> None:
    url, _ = index
    dead = f"http://127.0.0.1:{_closed_port()}/simple/"
    env = {"PYTHON": sys.executable, "FLASHCP_GPU_VENV": str(tmp_path / "venv"),
           "PADDLE_GPU_INDEX": url, "PIP_INDEX_URL": dead}  # fmt: skip
    proc = _run("--check-prereqs", env=env)
    assert proc.returncode == 5
    assert f"cannot reach the package index {dead}" in proc.stderr
    assert "set PIP_INDEX_URL" in proc.stderr


def test_given_wheel_directories_need_no_index(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}/"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {"PYTHON": sys.executable, "FLASHCP_GPU_VENV": str(tmp_path / "venv"),
           "PADDLE_GPU_INDEX": dead, "PIP_INDEX_URL": dead}  # fmt: skip
    proc = _run("--check-prereqs", str(wheels), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "reachable" not in proc.stdout


def test_full_run_stops_before_installing(tmp_path: Path) -> None:
    """The real run checks first: an unreachable index ends it with the summary, exit 5, and
    no venv was created."""
    dead = f"http://127.0.0.1:{_closed_port()}/"
    env = {"PYTHON": sys.executable, "FLASHCP_GPU_VENV": str(tmp_path / "venv"),
           "FLASHCP_GPU_CHECK_OUT": str(tmp_path / "out"), "FLASHCP_GPU_CHECK_COMPUTE_CAP": "9.0",
           "PADDLE_GPU_INDEX": dead}  # fmt: skip
    proc = _run(env=env)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert proc.stdout.count("flashcp GPU check: summary") == 1
    assert "- prerequisite: cannot reach the package index" in proc.stdout
    assert not (tmp_path / "venv").exists()


# -- the GPU tests: without the deterministic flags, then the unit tests with them -------------

FAKE_GPU_PYTHON = """\
echo "$* | FLAGS_cudnn_deterministic=${FLAGS_cudnn_deterministic-unset}" >>"$STUB_LOG"
if [ "$1" = - ]; then
  code=$(cat)
  case "$code" in
    *is_compiled_with_cuda*)
      echo "Fake H100 (SM 9.0), $STUB_GPUS device(s), Paddle 3.3.1, CUDA 12.6" ;;
    *probe_fa3*) printf 'available: fake\\nnot applicable: fake\\n' ;;
    *) printf '%s' "$code" | "$REAL_PYTHON" "$@" ;;  # the script's own report code
  esac
elif [ "$1 $2" = "-m flashcp" ]; then
  echo "Effective fa_version: 3"
elif [ "$1 $2" = "-m pytest" ]; then
  echo "============ 7 passed, 1 skipped in 1.00s ============"
elif [ "$1" = scripts/bench_collective_sync.py ]; then
  echo '{"config": "tiny_ep", "step_time_s": {"tracked": {"median": 0.5},' \
    '"drain": {"median": 0.75}}, "drain_over_tracked": {"median": 1.5}}' >"$6"
fi
"""


@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_tests_run_without_then_with_the_deterministic_flag(tmp_path: Path, gpus: int) -> None:
    log = tmp_path / "calls.log"
    fake = _stub(tmp_path / "python", FAKE_GPU_PYTHON)
    env = {"FLASHCP_GPU_CHECK_SKIP_INSTALL": "1", "FLASHCP_GPU_CHECK_PYTHON": str(fake),
           "FLASHCP_GPU_CHECK_OUT": str(tmp_path / "out"), "STUB_LOG": str(log),
           "STUB_GPUS": str(gpus), "REAL_PYTHON": sys.executable,
           "FLAGS_cudnn_deterministic": "1"}  # the caller's environment has it  # fmt: skip
    proc = _run(env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pytest_calls = [line for line in log.read_text().splitlines() if line.startswith("-m pytest")]
    assert len(pytest_calls) == 2, pytest_calls
    default, deterministic = pytest_calls
    assert default.startswith("-m pytest -m gpu tests -p")
    assert default.endswith("FLAGS_cudnn_deterministic=unset")
    assert deterministic.startswith("-m pytest -m gpu tests/unit -p")
    assert deterministic.endswith("FLAGS_cudnn_deterministic=1")
    assert "pytest -m gpu        7 passed, 0 failed, 0 errors, 1 skipped (exit 0)" in proc.stdout
    assert "deterministic unit   7 passed" in proc.stdout
    if gpus == 1:
        assert "collective drain     skipped: needs 2 GPUs" in proc.stdout
    else:  # the drain benchmark's job pair ran, and its ratio is in the summary
        assert "collective drain     step 0.500 s tracked, 0.750 s with the drain (x1.50)" in (
            proc.stdout
        )
    assert "result: PASS" in proc.stdout
