"""Every CI workflow is valid YAML with the jobs and commands the README promises."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.paths import ROOT

WORKFLOWS = ROOT / ".github" / "workflows"
EXPECTED = {
    "unit.yml": "scripts/test.sh unit",
    "integration-cpu.yml": "scripts/test.sh integration",
    "multi-card-gpu.yml": "scripts/gpu_check.sh",
    "coverage.yml": "scripts/test.sh all",
}


def test_expected_workflows_exist() -> None:
    assert {p.name for p in WORKFLOWS.glob("*.yml")} >= set(EXPECTED)


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.yml")), ids=lambda p: p.name)
def test_workflow_is_valid(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and doc.get("name")
    # PyYAML reads the bare key `on` as True.
    assert "on" in doc or True in doc
    jobs = doc["jobs"]
    assert jobs, f"{path.name} has no jobs"
    runs = []
    for name, job in jobs.items():
        assert "runs-on" in job, f"{path.name}:{name} has no runs-on"
        assert job.get("timeout-minutes"), f"{path.name}:{name} has no timeout"
        for step in job["steps"]:
            assert "uses" in step or "run" in step
            runs.append(step.get("run", ""))
    expected = EXPECTED.get(path.name)
    if expected:
        assert any(expected in r for r in runs), f"{path.name} never runs {expected}"


def test_gpu_workflow_targets_self_hosted_h20() -> None:
    doc = yaml.safe_load((WORKFLOWS / "multi-card-gpu.yml").read_text())
    job = doc["jobs"]["h20-multi-card"]
    assert "self-hosted" in job["runs-on"] and "h20" in job["runs-on"]
    assert job["env"]["FLAGS_cudnn_deterministic"] == "1"


def test_gpu_workflow_runs_on_every_pull_request_touching_src() -> None:
    """The gpu tier runs on every PR that touches src/ - not only under a label."""
    doc = yaml.safe_load((WORKFLOWS / "multi-card-gpu.yml").read_text())
    on = doc.get("on", doc.get(True))
    pr = on["pull_request"]
    assert "src/**" in pr["paths"]
    assert {"opened", "synchronize", "reopened"} <= set(pr["types"])
    assert "labeled" not in pr["types"]
    job = doc["jobs"]["h20-multi-card"]
    assert "if" not in job or "label" not in str(job["if"]), job.get("if")
    assert any("scripts/gpu_check.sh" in step.get("run", "") for step in job["steps"])


def test_ci_run_calls_the_readme_test_command() -> None:
    root = WORKFLOWS.parents[1]
    ci = (root / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
    assert "|| true" not in ci
    assert "bash scripts/test.sh" in (root / "README.md").read_text()
