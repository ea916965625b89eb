"""Launched training jobs on CPU (gloo): CP/DP layouts match one process, resume is exact.

The single-process reference trains `configs/gpt/tiny_cp2.yaml` with `parallel.cp=1` in this
process; each launched job runs the same model on the same data with another layout and dumps
its summed gradients every step (`debug.dump_grads`). Another layout sums in another order, so
losses, gradient norms and gradients (norm-wise) must agree within the float32 rule of
`bench.numerics` (reduction over the step's target tokens, growing with the step); the
token counts exactly. Resuming in the SAME layout repeats the same operations in the same
order: bitwise.
"""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from bench import numerics
from bench.jobs import flashcp_job, start_flashcp
from flashcp.launch.supervise import alive
from flashcp.metrics.writer import read_metrics
from helpers.launch import kill_marked, marked_pids
from helpers.paths import CONFIGS
from helpers.trainruns import assert_training_matches, losses, train_in_process, train_launched

pytestmark = pytest.mark.integration

CONFIG = CONFIGS / "gpt" / "tiny_cp2.yaml"
STEPS = 4
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "debug.dump_grads=true"]


def _reference(config: Path, out: Path, extra: list[str] | None = None) -> Path:
    """CP=1 in this process (no launcher): the run other layouts are compared with."""
    return train_in_process(config, out, [*COMMON, *(extra or []), "parallel.cp=1"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _reference(CONFIG, tmp_path_factory.mktemp("ref"))


def _launch(tmp: Path, nproc: int, overrides: list[str], config: Path = CONFIG) -> Path:
    """`config` launched on `nproc` processes with `overrides`, into `tmp/run`."""
    return train_launched(config, tmp / "run", nproc, [*COMMON, *overrides])


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory.mktemp("cp2"), 2, [])


@pytest.mark.equivalence
@pytest.mark.timeout(180)
def test_cp2_dualchunk_matches_cp1(cp2_run: Path, reference: Path) -> None:
    assert_training_matches(cp2_run, reference, steps=STEPS)


@pytest.mark.equivalence
@pytest.mark.timeout(180)
def test_cp4_workload_balanced_matches_cp1(tmp_path: Path, reference: Path) -> None:
    run = _launch(tmp_path, 4, ["parallel.cp=4", "parallel.cp_mode=workload_balanced"])
    assert_training_matches(run, reference, steps=STEPS)


@pytest.mark.equivalence
@pytest.mark.timeout(180)
def test_dp2_cp2_contiguous_matches_cp1(tmp_path: Path, reference: Path) -> None:
    # dp=2 × micro-batch 1 sees the same two sequences per step as dp=1 × micro-batch 2
    # (tiny gradient buckets: the all-reduce runs in many pieces)
    overrides = ["parallel.dp=2", "parallel.cp_mode=contiguous_allgather",
                 "data.micro_batch_size=1", "parallel.grad_bucket_mb=0.05"]  # fmt: skip
    run = _launch(tmp_path, 4, overrides)
    assert_training_matches(run, reference, steps=STEPS)


@pytest.mark.equivalence
@pytest.mark.timeout(180)
def test_glm_moe_recompute_cp2_matches_cp1(tmp_path: Path) -> None:
    # GLM-4.5-style MoE, full activation recompute, contiguous layout (configs/glm/tiny_moe_cp2),
    # with router load balancing on: the sequence-balance loss gathers each sequence's
    # statistics over the cp group (its gradient is in the compared gradients), and the bias
    # update uses loads summed over the cp ranks (the routing of later steps depends on it)
    config = CONFIGS / "glm" / "tiny_moe_cp2.yaml"
    balance = ["model.router_aux_loss_coef=0.01", "model.router_bias_update_rate=0.01"]
    ref = _reference(config, tmp_path / "ref", balance)
    run = _launch(tmp_path, 2, balance, config=config)
    assert_training_matches(run, ref, steps=STEPS)
    for got, want in zip(read_metrics(run), read_metrics(ref), strict=True):
        assert got["moe/max_over_mean_max"] == want["moe/max_over_mean_max"]  # integer loads
        aux = float(want["moe/aux_loss"])  # a mean over the step's tokens, like the loss
        numerics.assert_close(got["moe/aux_loss"], aux, n=float(want["targets"]), scale=aux,
                              steps=int(want["step"]), what="moe/aux_loss")  # fmt: skip


# -- flashcp train ----------------------------------------------------------------------------


def _run_flashcp(args: list[str], timeout: float = 120) -> tuple[int, str]:
    marker = uuid.uuid4().hex
    job = flashcp_job(args[0], args[1:], marker)
    try:
        code, timed_out, out = job.wait(timeout)
        if timed_out:
            pytest.fail(f"flashcp train timed out:\n{out}")
    finally:
        kill_marked(marker)
    return code, out


@pytest.mark.timeout(240)
def test_flashcp_train_resume_reproduces_losses_exactly(tmp_path: Path, cp2_run: Path) -> None:
    out = tmp_path / "resumed"
    args = [str(CONFIG), f"train.steps={STEPS}", "checkpoint.every=2", f"run.output_dir={out}"]
    code, text = _run_flashcp([*args, "run.stop_after_steps=2"])
    assert code == 0, text
    assert "launching 2 process(es)" in text and "step 2/4" in text
    assert "LAUNCH INFO" not in text  # the launcher's banner stays in logs/launcher.log
    assert (out / "checkpoints" / "step_2" / "manifest.json").is_file()
    assert (out / "logs" / "workerlog.1").is_file() and (out / "logs" / "launcher.log").is_file()
    code, text = _run_flashcp(args)
    assert code == 0, text
    assert "resumed from" in text and "step 4/4" in text
    assert losses(out) == losses(cp2_run)  # bitwise: 2 + 2 steps == 4 uninterrupted steps


@pytest.mark.timeout(180)
def test_flashcp_train_reports_a_broken_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [str(CONFIG), "train.steps=1", "checkpoint.every=1", f"run.output_dir={out}"]
    assert _run_flashcp(args)[0] == 0
    model = out / "checkpoints" / "step_1" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    code, text = _run_flashcp([*args, f"checkpoint.resume={model.parent}"])
    assert code == 4, text
    assert "is broken and was not loaded" in text and "truncated" in text


@pytest.mark.timeout(180)
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    marker = uuid.uuid4().hex
    args = [str(CONFIG), "train.steps=5000", "checkpoint.every=0", f"run.output_dir={out}"]
    proc = start_flashcp(args[0], args[1:], marker)
    try:
        deadline = time.monotonic() + 90
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        workers = [p for p in marked_pids(marker) if alive(p)]
        assert len(workers) >= 3, workers  # flashcp, the launcher and its 2 workers
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGINT, text
        # Ctrl-C saves and stops like a pre-emption; the console's last line says so (issue 37)
        last = text.strip().splitlines()[-1]
        saved = re.search(r"saved step (\d+) \((.*?)\); run the same command again", last)
        assert last.startswith("flashcp: ") and last.endswith("exit 130") and saved, last
        assert Path(saved.group(2)).is_dir() and saved.group(2).endswith(f"step_{saved.group(1)}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in marked_pids(marker)):
            time.sleep(0.2)
        assert [p for p in marked_pids(marker) if alive(p)] == []
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert 2 <= len(steps) < 5000
    finally:
        kill_marked(marker)
        if proc.poll() is None:
            proc.kill()
