"""Smoke test of `scripts/memory_check.py` (`bench.memory_check`): tiny cases (one with the
activation offload's host bytes) measured against their plan, a report."""

from __future__ import annotations

import json
from pathlib import Path

from bench import memory_check as check


def test_memory_check_smoke(tmp_path: Path) -> None:
    cases = tmp_path / "cases.yaml"
    cases.write_text(
        "- name: tiny\n"
        "  config: configs/gpt/tiny_cp2.yaml\n"
        "  overrides: [parallel.cp=1, data.seq_len=64, train.loss_chunk_tokens=0]\n"
        "  note: tiny GPT\n"
        "- name: tiny_offload\n"
        "  config: configs/glm/tiny_cp2.yaml\n"
        "  overrides: [parallel.cp=1, data.seq_len=64, model.recompute=full,\n"
        "              train.offload_activations=true]\n"
        "  note: tiny GLM, offloaded layer inputs\n"
        "- name: huge\n"
        "  config: configs/glm/glm4_9b_cp8.yaml\n"
        "  overrides: [parallel.cp=1, data.seq_len=64, run.device=cpu, train.dtype=float32]\n"
        "  drop: [attention]\n"
        "  note: too big here\n"
    )
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    args = ["--cases", str(cases), "--json", str(out), "--markdown", str(md), "--steps", "2"]
    assert check.main([*args, "--max-gib", "4"]) == 0
    data = json.loads(out.read_text())
    tiny, offload, huge = data["cases"]
    (rank,) = tiny["ranks"]
    assert rank["predicted_bytes"] == data["cases"][0]["plan"]["ranks"][0]["total_bytes"]
    assert rank["peak_bytes"] >= rank["train_peak_bytes"] > rank["after_build_bytes"] > 0
    assert abs(rank["ratio"] - 1) <= 0.15 and tiny["within"] is True
    # the offloaded bytes as the trainer's step metrics count them at the copies = the plan's
    (off_rank,) = offload["ranks"]
    assert off_rank["host_peak_bytes"] == off_rank["predicted_host_bytes"] > 0
    assert off_rank["host_ratio"] == 1.0 and offload["within"] is True
    assert rank["host_peak_bytes"] == 0 and "host_ratio" not in rank  # no offload, no ratio
    assert "needs ~" in huge["skipped"] and "ranks" not in huge
    assert [g["config"] for g in data["gpu_plans"]] == list(check.GPU_CONFIGS)
    text = md.read_text()
    assert "| tiny | 1 | 0 (0) |" in text and "not run: needs" in text
    assert "2 of 2 measured configs have every rank within ±15 %" in text
    air = next(g for g in data["gpu_plans"] if g["config"].endswith("glm45_air_cp8.yaml"))
    assert air["fits"] and air["fit_options"] == []  # the shipped config fits as it is
    assert f"glm45_air_cp8.yaml` — {air['world']} GPUs ({air['nodes']} nodes of 8)" in text
    assert "Changes that fit 96 GiB" not in text  # every shipped GPU config fits
    md.unlink()
    assert check.main(["--json", str(out), "--markdown", str(md), "--report-only"]) == 0
    assert md.is_file()
    # --update runs one case again and keeps the other's record
    assert check.main([*args, "--max-gib", "4", "--update", "--only", "tiny"]) == 0
    again = json.loads(out.read_text())["cases"]
    assert [c["name"] for c in again] == ["tiny", "tiny_offload", "huge"]
    assert "skipped" in again[2]


def test_host_ratio_compares_the_measured_bytes_with_the_plan() -> None:
    """The case's host ratio: measured offload bytes over the plan's host item; without an
    offload nothing is planned and no ratio is given."""
    from flashcp.config import load_config
    from flashcp.plan import plan
    from flashcp.plan.features import Features

    cfg = load_config(Path(check.ROOT) / "configs/glm/tiny_cp2.yaml", ["model.recompute=full"])
    p = plan(cfg, features=Features(offload_activations=True))
    planned = p.host.ranks[0].moments["training step"]["offloaded_activations"]  # type: ignore[union-attr]
    m = {"host_peak_bytes": planned}
    check._host(m, p, 0)
    assert m["predicted_host_bytes"] == planned > 0 and m["host_ratio"] == 1.0
    off = {"host_peak_bytes": 0}
    check._host(off, plan(cfg), 0)
    assert "host_ratio" not in off  # nothing planned, nothing measured
