"""Every `attention.mask` family at CP = 1 against its CP = 2 golden job.

Each shipped `configs/**/tiny_*.yaml` that picks a mask other than causal is a golden job run
at CP = 2 by the integration tier (`tests/integration/test_jobs.py` holds the job to
`tests/golden/losses.json`). Here the same config trains in this process at `parallel.cp=1`
with the golden overrides and must reach the same losses and gradient norms within the float32
rule of `bench.numerics`: CP 2 equals CP 1 for every family, end to end (data, packing, mask,
model, loss), without launching a job. The attention alone, for every layout at CP 2 and 4:
`tests/unit/attention/test_allgather_kv.py`.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from bench import jobs
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.paths import ROOT

MASK_CONFIGS = sorted(
    c for c in jobs.discover_configs() if load_config(ROOT / c).attention.mask != "causal"
)


def _train_cp1(config: str, out: Path, *extra: str) -> dict[int, dict]:
    """`config` trained here at cp 1 with the golden overrides: its metrics by step."""
    overrides = [*jobs.golden_overrides(), "parallel.cp=1", *extra, f"run.output_dir={out}"]
    Trainer(load_config(ROOT / config, overrides), stream=io.StringIO()).fit()
    return {int(r["step"]): r for r in read_metrics(out)}


def _misses(config: str, rows: dict[int, dict]) -> list[str]:
    """The golden comparisons (loss, gradient norm per check step) `rows` fail."""
    entry = jobs.load_golden()["jobs"][config]
    found = []
    for step in entry["losses"]:
        row = rows[int(step)]
        for c in (jobs.compare_loss(entry, step, row["loss"]),
                  jobs.compare_grad_norm(entry, step, row["grad_norm"])):  # fmt: skip
            if not c.ok:
                found.append(c.describe())
    return found


def test_every_mask_family_has_a_cp2_golden_job() -> None:
    golden = jobs.load_golden()["jobs"]
    kinds = {load_config(ROOT / c).attention.mask for c in MASK_CONFIGS}
    assert kinds == {"sliding_window", "global_window", "prefix_lm"}
    for config in MASK_CONFIGS:
        assert load_config(ROOT / config).parallel.cp == 2 and golden[config]["nproc"] == 2


@pytest.mark.equivalence
@pytest.mark.parametrize("config", MASK_CONFIGS)
def test_cp1_trains_to_the_cp2_golden(config: str, tmp_path: Path) -> None:
    assert _misses(config, _train_cp1(config, tmp_path)) == []


def test_the_comparison_sees_the_mask(tmp_path: Path) -> None:
    """Negative control: the window config trained with plain causal documents misses its
    golden, so the rule is tight enough to tell the families apart."""
    config = "configs/gpt/tiny_sliding_window_cp2.yaml"
    causal = _train_cp1(config, tmp_path, "attention.mask=causal", "attention.sliding_window=null")
    assert _misses(config, causal)
