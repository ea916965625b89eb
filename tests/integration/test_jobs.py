"""Every shipped tiny config as a real `flashcp train` job: clean, and on its golden losses.

Each `configs/**/tiny_*.yaml` (found automatically, so new ones are covered the day they ship)
runs with its own dp×pp×cp processes over gloo on CPU, deterministic, for 4 steps. The job must
exit 0, every rank must report `exit 0` after tearing its process groups down, no log may hold
abort/assertion/crash text, no process may be left behind, and the losses at steps 1, 2 and 4
(read from `metrics.jsonl`) must match `tests/golden/losses.json` within the float32 rule of
`bench.numerics` (the goldens were written on one CPU; another sums in another order). A
config without a golden entry FAILS, naming `scripts/update_golden.py`.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from bench import jobs
from flashcp.metrics.writer import read_metrics

pytestmark = pytest.mark.integration

CONFIGS = jobs.discover_configs()


def test_tiny_configs_are_discovered() -> None:
    assert {"configs/gpt/tiny_cp2.yaml", "configs/gpt/tiny_cp4.yaml"} <= set(CONFIGS)
    sizes = {jobs.world_size(c) for c in CONFIGS}
    assert {2, 4} <= sizes, sizes  # both 2- and 4-process jobs are exercised


def test_golden_file_has_no_stale_entries() -> None:
    stale = sorted(set(jobs.load_golden()["jobs"]) - set(CONFIGS))
    assert not stale, f"golden entries for configs that no longer ship: {stale}; " + (
        jobs.UPDATE_HINT
    )


@pytest.mark.equivalence
@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", CONFIGS)
def test_tiny_config_job_is_clean_and_golden(config: str, tmp_path: Path) -> None:
    run = jobs.run_flashcp(config, jobs.golden_overrides(), tmp_path / "run")
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert f"launching {run.nproc} process(es)" in run.output
    assert "[flashcp] rank" not in run.output  # exit lines stay in the logs
    losses = run.losses()
    assert sorted(losses) == list(range(1, jobs.GOLDEN_STEPS + 1)), losses
    want = jobs.load_golden()["jobs"].get(config)
    problems = jobs.compare_losses(config, want, jobs.golden_entry(run))
    assert not problems, "\n".join(problems)
    if "mtp" in Path(config).stem:  # trained MTP layers: their loss falls too (issue 23)
        mtp = [float(r["mtp_loss"]) for r in read_metrics(run.out_dir)]
        assert len(mtp) == jobs.GOLDEN_STEPS and mtp[-1] < mtp[0] - 0.05, mtp


FAMILY_CONFIGS = [c for c in CONFIGS if Path(c).parts[1] in ("ernie", "llama", "qwen")]
"""The newer families' tiny configs, each also run as one process (`test_..._one_process_run`)."""


def test_every_new_family_ships_a_tiny_config() -> None:
    assert {"configs/ernie/tiny_cp2.yaml", "configs/ernie/tiny_moe_ep2_cp2.yaml",
            "configs/llama/tiny_cp2.yaml", "configs/qwen/tiny_qwen2_cp2.yaml",
            "configs/qwen/tiny_qwen3_cp2.yaml", "configs/qwen/tiny_qwen3_moe_ep2_cp2.yaml",
            "configs/qwen/tiny_qwen3_dpo_lora_cp2.yaml"} <= set(FAMILY_CONFIGS)  # fmt: skip


@pytest.mark.equivalence
@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", FAMILY_CONFIGS)
def test_a_family_config_equals_its_one_process_run(config: str, tmp_path: Path) -> None:
    """The same config on ONE process (cp 1, ep 1: no sharding, no token exchange) gives the
    CP 2 (and EP 2) golden job's losses and gradient norms under the float32 rule."""
    one = [*jobs.golden_overrides(), "parallel.cp=1", "parallel.ep=1"]
    run = jobs.run_flashcp(config, one, tmp_path / "run", nproc=1)
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert run.nproc == 1 and "launching 1 process(es)" in run.output
    want = jobs.load_golden()["jobs"][config]
    got = jobs.golden_entry(run)
    for step in want["losses"]:
        loss = jobs.compare_loss(want, step, got["losses"][step])
        norm = jobs.compare_grad_norm(want, step, got["grad_norms"][step])
        assert loss.ok and norm.ok, (config, loss, norm)


@pytest.mark.timeout(180)
def test_fixed_master_port(tmp_path: Path) -> None:
    """`FLASHCP_MASTER_PORT` pins the launcher's master port; the job runs as usual."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = jobs.run_flashcp(
        "configs/gpt/tiny_cp2.yaml",
        jobs.golden_overrides(steps=2),
        tmp_path / "run",
        env={"FLASHCP_MASTER_PORT": str(port)},
    )
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert f"master: 127.0.0.1:{port}" in run.launcher_log()
