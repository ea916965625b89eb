"""Smoke test of `scripts/bench_dpo.py` at tiny size: both layouts train, same pairs, report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_dpo.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_dpo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_dpo"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_dpo_smoke(tmp_path: Path) -> None:
    bench = _load()
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny_glm", "--seq-len", "256", "--repeat", "1", "--epochs", "1"]
    assert bench.main([*args, "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    packed, unpacked = rec["layouts"]["packed"], rec["layouts"]["unpacked"]
    assert rec["examples"] == 52 and rec["speedup"] > 0
    # the same pairs: every answer's initial reference log-prob agrees between the layouts
    assert rec["max_initial_ref_logp_diff"] < 1e-3
    assert packed["positions_per_pass"] < unpacked["positions_per_pass"]  # prompts once, less pad
    assert packed["example_positions_per_pass"] < rec["example_tokens_per_pass"]
    md = out.with_suffix(".md").read_text()
    assert "Speedup of packing" in md and "| packed |" in md
    assert bench.main(["--json", str(out), "--report-only"]) == 0
