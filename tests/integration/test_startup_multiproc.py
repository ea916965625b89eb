"""A rank that builds slower than the collective timeout does not stop the job (issue 21 item 7).

Real 2-process gloo jobs of the pipeline + LoRA config, whose build runs collectives after the
model exists (the LoRA target check and the trainable-names gather over pp, the run info over
the world). Rank 1 builds its model 8 s late while `FLASHCP_COLLECTIVE_TIMEOUT` is 3 s: the
ranks meet at the barrier after the build, which, like every collective before the first step,
waits `FLASHCP_STARTUP_TIMEOUT`, and the job trains. Negative control: with a start-up timeout
shorter than the skew the job stops at that barrier, naming it (exit 124).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.launch import run_launch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "glm" / "tiny_dpo_lora_pp2.yaml"
WORKER = Path(__file__).resolve().parent / "workers" / "slow_build_train.py"
SKEW = {"FLASHCP_TEST_SLOW_RANK": "1", "FLASHCP_TEST_SLOW_SECONDS": "8",
        "FLASHCP_COLLECTIVE_TIMEOUT": "3"}  # fmt: skip
ARGS = ["train.steps=1", "checkpoint.every=0", "checkpoint.resume=never"]


def _launch(tmp: Path, startup_timeout: str):
    out = tmp / "run"
    env = {**SKEW, "FLASHCP_STARTUP_TIMEOUT": startup_timeout}
    return out, run_launch(WORKER, 2, ["--config", str(CONFIG), *ARGS, f"run.output_dir={out}"],
                           timeout=150, env=env, log_dir=tmp / "logs")  # fmt: skip


@pytest.mark.timeout(200)
def test_slow_build_on_one_rank_waits_at_the_startup_barrier(tmp_path: Path) -> None:
    out, result = _launch(tmp_path, "60")
    assert result.ok, result.summary()
    assert result.leftover == [], result.summary()
    assert (out / "metrics.jsonl").read_text().count("\n") == 1  # the step ran


@pytest.mark.timeout(200)
def test_startup_timeout_shorter_than_the_skew_stops_at_the_barrier(tmp_path: Path) -> None:
    _, result = _launch(tmp_path, "2")
    assert not result.ok and not result.timed_out, result.summary()
    log = result.log(0)
    assert "barrier after building the model on group world[0,1] timed out after 2 s" in log, (
        result.summary()
    )
    assert result.leftover == [], result.summary()
