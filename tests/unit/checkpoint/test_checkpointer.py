"""`flashcp.checkpoint.Checkpointer` on its own, and the rule that it is the one reader/writer.

The trainer-level behaviour (bitwise resume, layouts, LoRA exports) is tested through
`Trainer.fit` elsewhere (`test_trainer.py`, `optim/test_zero.py`, `test_resume_fixtures.py`,
the integration jobs); here: what `resume` returns and restores (the data position, the LR
schedule, each RNG, against the checkpoint's trainer state), the files it refuses, and where in
the source tree checkpoint files may be opened at all.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import paddle

from flashcp.checkpoint.checkpointer import Checkpointer, Resumed
from flashcp.checkpoint.state import rng_state
from flashcp.config import load_config
from flashcp.trainer import Trainer
from helpers.paths import FIXTURES, ROOT

SRC = ROOT / "src" / "flashcp"
FIXTURE = FIXTURES / "checkpoints" / "plain" / "run"
HF_DIRECTORIES = {
    "models/hf_weights.py",
    "models/safetensors_io.py",
    "models/safetensors_stream.py",
}
"""Modules that read and write Hugging Face model directories (`checkpoint.init_from`,
`model.from_pretrained`, export shards), which are not flashcp checkpoints."""


def _checkpointer(run: Path) -> Checkpointer:
    cfg = load_config(run / "config.yaml", [f"run.output_dir={run}", "run.stop_after_steps=0"])
    return Trainer(cfg, stream=io.StringIO()).checkpointer


def _rewrite_state(step_dir: Path, drop: str) -> None:
    """Drop key `drop` from the trainer state, as an older flashcp wrote it (checksum kept)."""
    path = step_dir / "trainer_state.json"
    state = json.loads(path.read_text())
    del state[drop]
    path.write_text(json.dumps(state, indent=1, sort_keys=True))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    data = path.read_bytes()
    manifest["files"][path.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_resume_returns_the_step_and_the_recorded_tokens(tmp_path: Path) -> None:
    run = Path(shutil.copytree(FIXTURE, tmp_path / "run"))
    got = _checkpointer(run).resume(tokens_per_step=10)
    assert got == Resumed(path=run / "checkpoints" / "step_3", step=3, consumed_tokens=192)


def test_resume_restores_data_position_rng_and_lr_schedule(tmp_path: Path) -> None:
    """Besides the arrays, `resume` restores what the checkpoint's trainer state holds, each
    checked against that file: the data stream's position, the LR schedule and the RNGs. The
    RNGs are moved on first (the fixture saved the seeded state a fresh trainer also has), and
    so are the others (a fresh trainer starts at step 0), so nothing passes by coincidence. The
    fixture predates the CPU engine text: its Paddle generator is re-seeded from the saved seed
    (`flashcp.checkpoint.state`)."""
    run = Path(shutil.copytree(FIXTURE, tmp_path / "run"))
    saved = json.loads((run / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    checkpointer = _checkpointer(run)
    paddle.rand([5])
    np.random.rand(3)
    random.random()
    before = _restored(checkpointer)
    checkpointer.resume(tokens_per_step=10)
    after = _restored(checkpointer)
    paddle.seed(saved["rng"]["paddle"]["generators"][0]["seed"])
    want = {
        "data": saved["data"]["stream"],
        "scheduler": saved["scheduler"],
        "python": saved["rng"]["python"],
        "numpy": saved["rng"]["numpy"],
        "paddle": rng_state()["paddle"],
    }
    assert all(before[key] != want[key] for key in want), "the fixture would pass unrestored"
    assert after["data"] == want["data"], "the data position was not restored"
    assert after["scheduler"] == want["scheduler"], "the LR schedule was not restored"
    for key in ("python", "numpy", "paddle"):
        assert after[key] == want[key], f"the {key} RNG state was not restored"


def _restored(checkpointer: Checkpointer) -> dict[str, object]:
    """What `resume` restores besides the arrays, as plain data."""
    rng = rng_state()
    return {
        "data": checkpointer.data.state_dict()["stream"],  # (+ a window step when balanced)
        "scheduler": checkpointer.scheduler.state_dict(),
        **{key: rng[key] for key in ("python", "numpy", "paddle")},
    }


def test_resume_counts_tokens_a_checkpoint_did_not_record(tmp_path: Path) -> None:
    run = Path(shutil.copytree(FIXTURE, tmp_path / "run"))
    _rewrite_state(run / "checkpoints" / "step_3", "consumed_tokens")
    got = _checkpointer(run).resume(tokens_per_step=10)
    assert got is not None and got.consumed_tokens == 30  # 3 steps × 10 tokens


def test_resume_never_and_an_empty_run_load_nothing(tmp_path: Path) -> None:
    run = Path(shutil.copytree(FIXTURE, tmp_path / "run"))
    cfg = load_config(run / "config.yaml", [f"run.output_dir={run}", "checkpoint.resume=never"])
    assert Trainer(cfg, stream=io.StringIO()).checkpointer.resume(tokens_per_step=1) is None
    empty = tmp_path / "empty"
    cfg = load_config(run / "config.yaml", [f"run.output_dir={empty}"])
    assert Trainer(cfg, stream=io.StringIO()).checkpointer.source() is None


def test_only_the_checkpoint_package_opens_checkpoint_files() -> None:
    """safetensors files are opened (read or written) in `flashcp.checkpoint` and in the
    Hugging Face directory modules only; nothing below `checkpoint` imports it."""
    opener = re.compile(r"\b(safe_open|save_file|load_file)\(")
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("checkpoint/") or rel in HF_DIRECTORIES:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if opener.search(line) and not line.lstrip().startswith(("#", "`", '"')):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == [], "checkpoint files opened outside flashcp.checkpoint:\n" + "\n".join(found)
    below = ("optim", "lora", "models", "distributed", "data", "cp", "attention", "kernels")
    imports = [
        f"{path.relative_to(SRC)}"
        for package in below
        for path in sorted((SRC / package).rglob("*.py"))
        if re.search(r"^\s*(from|import) flashcp\.checkpoint", path.read_text(), re.M)
    ]
    assert imports == [], f"these modules import flashcp.checkpoint (a layer above): {imports}"
