"""Every model family under CP = 2 and 4 equals CP = 1 (logits and gradients, under the
numerics rule): GPT, GLM-4 and GLM-4.5-MoE in every CP mode × every recompute mode (none,
full, refined), ERNIE-4.5 (dense, MoE), Llama-3.1, Qwen2.5, Qwen3 and Qwen3-MoE in every CP
mode; see `workers/model_cp_worker.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp.attention.registry import MODES
from helpers.launch import run_launch

WORKER = Path(__file__).resolve().parent / "workers" / "model_cp_worker.py"
pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 4])
def test_models_cp_equals_single_process(nproc: int, tmp_path: Path) -> None:
    result = run_launch(WORKER, nproc, ["--out", str(tmp_path)], timeout=220)
    assert result.ok, result.summary()
    for rank in range(nproc):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        cases = report["cases"]
        assert len(cases) == 3 * len(MODES) * 3 + 6 * len(MODES)
        for case in cases:
            assert case["ok"], case
