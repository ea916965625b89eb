"""Smoke test of `scripts/bench_balance.py` (`bench.balance`) at small sizes: the modelled
cases plan the same tokens both ways and balance them, the CPU job's corpus and config are
what the page says, and the page is a function of the JSON alone."""

from __future__ import annotations

import json
from pathlib import Path

from bench import balance as bench
from flashcp.config import load_config
from flashcp.cp.work import WorkModel
from flashcp.models import preset


def test_model_cases_balance_every_mix() -> None:
    model = WorkModel.for_model(preset("glm4_9b"))
    for mix in bench.MIXES:
        case = bench.model_case(mix, 8192, 4, 2, steps=8, window=4, model=model)
        assert case["work"]["microbatch"]["mean"] <= case["none"]["microbatch"]["mean"]
        assert case["work"]["dp"]["mean"] < 1.05
        assert 0 < case["none"]["attention_share"] < 1
        if mix != "dpo":
            assert case["pieces_per_document"]["none"] >= 1.0


def test_cpu_job_inputs(tmp_path: Path) -> None:
    info = bench.write_corpus(tmp_path / "c.jsonl", 1024, 50_000)
    lengths = [len(json.loads(x)["text"]) + 2 for x in (tmp_path / "c.jsonl").open()]
    assert info["tokens"] == sum(lengths) >= 50_000 and info["documents"] == len(lengths)
    bench.write_config(tmp_path / "b.yaml", tmp_path / "c.jsonl", 1024, 8, 4)
    cfg = load_config(tmp_path / "b.yaml", ["data.balance=none"])
    layout = (cfg.parallel.dp, cfg.train.grad_accum, cfg.data.balance_window)
    assert layout == (2, bench.CPU_ACCUM, 4)


def test_page_from_the_json(tmp_path: Path) -> None:
    out = tmp_path / "balance.json"
    assert bench.main(["--part", "model", "--model-steps", "4", "--window", "2",
                       "--json", str(out)]) == 0  # fmt: skip
    md = out.with_suffix(".md").read_text()
    assert "### long_tail" in md and "### dpo" in md and "Measured on CPU" not in md
    assert bench.main(["--json", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == md
