"""The README's first command, `bash scripts/quickstart.sh`, succeeds every time in one checkout.

The real script runs twice into the same run directory (`RUN_DIR`, here under the test's
directory; `train.steps=3` passed through to the job to keep CI short). Between the runs,
`flashcp train` is asked for a fresh run over the first run's checkpoint and must refuse before
launching (one line, exit 2, nothing written); the launcher-direct path
(`python -m paddle.distributed.launch ... src/flashcp/train.py`) must refuse with the same line
and no traceback. The second quickstart moves the first run aside (`run.overwrite=true`), byte
for byte, and trains from scratch: the same losses as the first run (same layout, same order:
bitwise by construction).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from bench.jobs import leftover_after, run_flashcp, start_job
from flashcp.metrics.writer import read_metrics
from helpers.launch import run_launch
from helpers.paths import ROOT

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "scripts" / "quickstart.sh"
CONFIG = "configs/gpt/tiny_cp2.yaml"
TRAIN = ROOT / "src" / "flashcp" / "train.py"
STEPS = 3
TIMEOUT = 240.0

PY_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.M)
"""A Python traceback (not Paddle's "C++ Traceback" banner, which a SIGTERM prints)."""


def _quickstart(run_dir: Path) -> tuple[int, str]:
    """`RUN_DIR=run_dir bash scripts/quickstart.sh train.steps=3` from the repo root: its exit
    code and output; no process of it may outlive it."""
    marker = uuid.uuid4().hex
    job = start_job(
        ["bash", str(SCRIPT), f"train.steps={STEPS}"], marker, {"RUN_DIR": str(run_dir)}
    )
    code, timed_out, output = job.wait(TIMEOUT)
    if timed_out:
        pytest.fail(f"quickstart timed out after {TIMEOUT:.0f} s:\n{output}")
    assert leftover_after(marker) == [], output
    return code, output


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes (None for a directory) by path relative to `root`."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(run_dir)}


def _check_run(run_dir: Path, code: int, output: str) -> None:
    """One quickstart run: exit 0, the run directory printed first and last, a fresh run."""
    assert code == 0, output
    assert f"run directory: {run_dir} (an earlier run there is moved aside" in output, output
    assert output.rstrip().splitlines()[-1].startswith(f"== done: run directory {run_dir}:")
    assert "Traceback" not in output and "resumed from" not in output, output
    assert sorted(_losses(run_dir)) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS}"]
    assert (run_dir / "metrics.png").stat().st_size > 0


@pytest.mark.timeout(3 * TIMEOUT)
def test_quickstart_twice_refusal_between_and_overwrite_keeps_the_old_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "quickstart"
    code, output = _quickstart(run_dir)
    _check_run(run_dir, code, output)
    first = _tree(run_dir)
    first_losses = _losses(run_dir)

    # flashcp train: a fresh run over those checkpoints is refused before launching
    refusal = (
        f"flashcp: cannot launch: run.output_dir: {run_dir} already holds checkpoints "
        f"(step_{STEPS}) and checkpoint.resume is never: set checkpoint.resume=auto to continue "
        "that run, run.overwrite=true to move it aside and start over, or choose another "
        "run.output_dir"
    )
    job = run_flashcp(CONFIG, [f"train.steps={STEPS}", "checkpoint.resume=never"], run_dir)
    assert job.returncode == 2, job.summary()
    assert job.output.splitlines() == [refusal], job.output  # one line, nothing launched
    assert job.leftover == []
    assert _tree(run_dir) == first  # no new logs, nothing touched

    # the launcher-direct path: every rank refuses before distributed init, rank 0 says why
    logs = tmp_path / "direct_logs"
    direct = run_launch(
        TRAIN,
        2,
        ["--config", str(ROOT / CONFIG), "checkpoint.resume=never", f"run.output_dir={run_dir}"],
        timeout=120,
        log_dir=logs,
    )
    # Paddle's launcher stops the other ranks at the first rank's exit and returns the status
    # of the rank it reaps: 2, or 241 (SIGTERM) when it caught a peer still in interpreter
    # teardown after its exit line (seen in CI). Each rank's own code is its exit line.
    assert direct.returncode in (2, 256 - 15) and not direct.timed_out, direct.summary()
    assert direct.leftover == []
    line = refusal.removeprefix("flashcp: cannot launch: ")
    assert direct.log(0).startswith(f"{line}\n[flashcp] rank 0 exit 2\n"), direct.summary()
    assert "[flashcp] rank 1 exit 2\n" in direct.log(1), direct.summary()
    assert line not in direct.log(1)  # said once, by rank 0
    for rank in range(2):  # (the launcher may SIGTERM rank 1 during its exit: Paddle then
        # prints a "C++ Traceback" block; a Python traceback starts a line with "Traceback")
        assert not PY_TRACEBACK.search(direct.log(rank)), direct.summary()
    assert _tree(run_dir) == first

    # the second quickstart moves the first run aside, byte for byte, and starts over
    code, output = _quickstart(run_dir)
    said = rf"^flashcp: run\.overwrite: moved the earlier run in {re.escape(str(run_dir))} to "
    moved = re.findall(said + r"(\S+)$", output, re.M)
    assert len(moved) == 1, output
    aside = Path(moved[0])
    assert aside.parent == tmp_path and aside.name.startswith("quickstart.old-"), aside
    assert _tree(aside) == first  # every file of the first run, byte-identical
    _check_run(run_dir, code, output)
    assert _losses(run_dir) == first_losses  # from scratch: same layout, same order, bitwise
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["quickstart", aside.name, "direct_logs"]
    )
