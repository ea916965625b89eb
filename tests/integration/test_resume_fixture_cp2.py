"""The kept cp = 2 ZeRO-1 checkpoint (`tests/fixtures/checkpoints/zero_cp2`) resumes in the
layout that wrote it: 2 launched ranks, one optimizer shard file each.

Same layout, same operations in the same order: the resumed losses are bitwise the recorded
ones when this machine's kernels reproduce the fixture's first steps bitwise (a fresh 2-rank
run of its config shows it), else within the float32 rule of `bench.numerics`. The
one-process resumes and the negative controls are `tests/unit/checkpoint/test_resume_fixtures.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import numerics
from flashcp.metrics.writer import read_metrics
from helpers.paths import FIXTURES
from helpers.trainruns import train_launched

pytestmark = pytest.mark.integration

FIXTURE = FIXTURES / "checkpoints" / "zero_cp2"


@pytest.mark.timeout(400)
def test_sharded_cp2_checkpoint_resumes_in_its_layout(tmp_path: Path) -> None:
    exp = json.loads((FIXTURE / "expected.json").read_text())
    k, steps, nproc = exp["resumed_at"], exp["steps"], exp["nproc"]
    run = Path(shutil.copytree(FIXTURE / "run", tmp_path / "run"))
    config = tmp_path / "config.yaml"
    shutil.copyfile(run / "config.yaml", config)
    first_fit = "data.balance=none"  # the fixture predates data.balance
    train_launched(config, run, nproc, ["run.stop_after_steps=0", first_fit])
    log = (tmp_path / "run_logs" / "workerlog.0").read_text()
    assert f"resumed from {run / 'checkpoints' / f'step_{k}'} at step {k}" in log
    assert "changed config" not in log
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert got[:k] == read_metrics(FIXTURE / "run")
    for row, want in zip(got[k:], exp["metrics"][k:], strict=True):
        n, scale = numerics.metric_basis(want, "loss")
        numerics.assert_close(row["loss"], want["loss"], n=n, scale=scale, steps=int(row["step"]),
                              what=f"loss step {row['step']}")  # fmt: skip
    fresh = train_launched(config, tmp_path / "fresh", nproc, [
        "checkpoint.every=0", "checkpoint.resume=never", f"run.stop_after_steps={k}", first_fit,
    ])  # fmt: skip
    # losses alone may agree while a backward kernel differs (MKL's AVX2 path): both must
    same_kernels = [(r["loss"], r["grad_norm"]) for r in read_metrics(fresh)] == [
        (r["loss"], r["grad_norm"]) for r in exp["metrics"][:k]
    ]
    print(f"this machine reproduces the fixture's first {k} steps bitwise: {same_kernels}")
    if same_kernels:
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in got[k:]] == [r[key] for r in exp["metrics"][k:]], key
