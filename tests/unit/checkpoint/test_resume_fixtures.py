"""Checkpoints written by an earlier flashcp resume with this one (`tests/fixtures/checkpoints`).

Each fixture is a run directory stopped at step `resumed_at` with its checkpoint, and the
metrics of the same config trained without interruption (`tests/fixtures/make_checkpoints.py`
says how both were made). Resuming the copied run directory must reproduce the recorded steps
after the checkpoint: bitwise when this machine's kernels reproduce the fixture's own first
steps bitwise (same ops, same order, same CPU kernels) and the layout is the one that wrote it;
else within the float32 rule of `bench.numerics`. A negative control perturbs one saved
tensor (checksums rewritten, so the checkpoint loads) and the comparison must reject the run.
The cp = 2 fixture resumes here in one process (another layout: the rule); its same-layout,
bitwise resume is `tests/integration/test_resume_fixture_cp2.py`.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from bench import numerics
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.paths import FIXTURES

CHECKPOINTS = FIXTURES / "checkpoints"


def expected(name: str) -> dict[str, Any]:
    return json.loads((CHECKPOINTS / name / "expected.json").read_text())


def copy_run(name: str, tmp: Path) -> Path:
    """The fixture's run directory, copied (a resume writes into it)."""
    return Path(shutil.copytree(CHECKPOINTS / name / "run", tmp / name))


def train(run: Path, *overrides: str) -> str:
    """Train the run directory's own `config.yaml` in it, to the end; returns the output. The
    fixtures predate `data.balance`: they packed first-fit (`data.balance=none`)."""
    cfg = load_config(
        run / "config.yaml",
        [f"run.output_dir={run}", "run.stop_after_steps=0", "data.balance=none", *overrides],
    )
    out = io.StringIO()
    Trainer(cfg, stream=out).fit()
    return out.getvalue()


def reproduces_history(name: str, tmp: Path, *overrides: str) -> bool:
    """Whether this machine trains the fixture's first steps to the bitwise same losses and
    gradient norms (a fresh run of its config): then its kernels are the ones that wrote the
    fixture (losses alone may agree while a backward kernel differs, e.g. MKL's AVX2 path)."""
    exp = expected(name)
    run = tmp / f"{name}_fresh"
    run.mkdir()
    (run / "config.yaml").write_text((CHECKPOINTS / name / "run" / "config.yaml").read_text())
    k = exp["resumed_at"]
    train(run, "checkpoint.every=0", "checkpoint.resume=never",
          f"run.stop_after_steps={k}", *overrides)  # fmt: skip
    pairs = lambda rows: [(r["loss"], r["grad_norm"]) for r in rows]  # noqa: E731
    return pairs(read_metrics(run)) == pairs(exp["metrics"][:k])


def comparisons(run: Path, name: str, beta: float | None = None) -> list[numerics.Comparison]:
    """The resumed steps' losses against the recorded ones, under the float32 rule."""
    exp = expected(name)
    k = exp["resumed_at"]
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, exp["steps"] + 1))
    out = []
    for row, want in zip(got[k:], exp["metrics"][k:], strict=True):
        assert row["targets"] == want["targets"] and row["tokens"] == want["tokens"]
        n, scale = numerics.metric_basis(want, "loss", beta=beta)
        what = f"{name} loss step {row['step']}"
        step = int(row["step"])
        out.append(numerics.compare(row["loss"], want["loss"], n=n, scale=scale, steps=step,
                                    what=what))  # fmt: skip
    return out


def check_resumed(run: Path, name: str, output: str, *, bitwise: bool, beta: float | None = None):
    exp = expected(name)
    k = exp["resumed_at"]
    assert f"resumed from {run / 'checkpoints' / f'step_{k}'} at step {k}" in output
    assert "changed config" not in output, output  # the saved config hash still matches
    got = read_metrics(run)
    fixture = read_metrics(CHECKPOINTS / name / "run")
    assert got[:k] == fixture  # the earlier records are kept as they were
    for c in comparisons(run, name, beta):
        assert c.ok, c.describe()
    if bitwise:
        assert [r["loss"] for r in got[k:]] == [r["loss"] for r in exp["metrics"][k:]]
        assert [r["grad_norm"] for r in got[k:]] == [r["grad_norm"] for r in exp["metrics"][k:]]


def perturb(step_dir: Path, file: str, key: str, delta: float) -> None:
    """Add `delta` to saved tensor `key` of `file` (metadata kept) and rewrite its checksum, so
    the checkpoint still loads, with one wrong value."""
    path = step_dir / file
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
        arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    arrays[key] = (arrays[key] + np.float32(delta)).astype(arrays[key].dtype)
    save_file(arrays, str(path), metadata=metadata)
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = path.read_bytes()
    manifest["files"][file] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def rejected(run: Path, name: str, beta: float | None = None) -> bool:
    """Whether some resumed step fails the rule by at least 10× its allowance."""
    return any(c.error > 10 * c.allowed for c in comparisons(run, name, beta))


# -- plain: model.safetensors + optimizer.safetensors ----------------------------------------


def test_plain_checkpoint_resumes(tmp_path: Path) -> None:
    run = copy_run("plain", tmp_path)
    output = train(run)
    check_resumed(run, "plain", output, bitwise=reproduces_history("plain", tmp_path))


def test_plain_checkpoint_perturbed_is_caught(tmp_path: Path) -> None:
    run = copy_run("plain", tmp_path)
    perturb(run / "checkpoints" / "step_3", "model.safetensors", "model.norm.weight", 0.1)
    train(run)
    assert rejected(run, "plain")


def test_plain_checkpoint_perturbed_moments_are_caught(tmp_path: Path) -> None:
    """The optimizer state is read, not re-initialised: a wrong second moment shows."""
    run = copy_run("plain", tmp_path)
    perturb(run / "checkpoints" / "step_3", "optimizer.safetensors",
            "model.embed_tokens.weight::moment2_0", 1e-3)  # fmt: skip
    train(run)
    assert rejected(run, "plain")


# -- LoRA: adapters in PaddleFormers' format --------------------------------------------------


def test_lora_checkpoint_resumes(tmp_path: Path) -> None:
    run = copy_run("lora", tmp_path)
    output = train(run)
    beta = expected("lora")["config"]["dpo"]["beta"]
    check_resumed(run, "lora", output, bitwise=reproduces_history("lora", tmp_path), beta=beta)
    # the end of the run exports the adapters as before
    assert (run / "adapters" / "peft_model-00001-of-00001.safetensors").is_file()
    assert (run / "adapters" / "lora_config.json").is_file()


def test_lora_checkpoint_perturbed_is_caught(tmp_path: Path) -> None:
    run = copy_run("lora", tmp_path)
    perturb(run / "checkpoints" / "step_3", "adapters/peft_model-00001-of-00001.safetensors",
            "model.layers.1.self_attn.v_proj.lora_B", 2.0)  # fmt: skip
    train(run)
    assert rejected(run, "lora", beta=expected("lora")["config"]["dpo"]["beta"])


# -- ZeRO-1 shards written by cp = 2 ranks, resumed in one process ---------------------------


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "unsharded"])
def test_sharded_cp2_checkpoint_resumes_in_one_process(tmp_path: Path, shard: bool) -> None:
    """Another layout (cp = 1, one shard file or the plain optimizer) reading the two shard
    files: the losses follow the cp = 2 run's within the rule."""
    run = copy_run("zero_cp2", tmp_path)
    output = train(run, "parallel.cp=1", f"parallel.shard_optimizer={str(shard).lower()}")
    assert f"resumed from {run / 'checkpoints' / 'step_3'} at step 3" in output
    assert all(c.ok for c in comparisons(run, "zero_cp2")), [
        c.describe() for c in comparisons(run, "zero_cp2")
    ]


def test_sharded_cp2_checkpoint_perturbed_master_is_caught(tmp_path: Path) -> None:
    run = copy_run("zero_cp2", tmp_path)
    shard = "optimizer-00001-of-00001.shard-00002-of-00002.safetensors"
    perturb(run / "checkpoints" / "step_3", shard, "master", 0.2)
    train(run, "parallel.cp=1")
    assert rejected(run, "zero_cp2")
