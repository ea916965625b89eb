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
import pytest

from flashcp import faults
from flashcp.checkpoint import format as ck
from flashcp.checkpoint.checkpointer import Checkpointer, Resumed
from flashcp.checkpoint.saving import SaveError
from flashcp.checkpoint.state import rng_state
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.configs import TinyCfg
from helpers.paths import FIXTURES, ROOT
from helpers.trainruns import Fit, losses

SRC = ROOT / "src" / "flashcp"
FIXTURE = FIXTURES / "checkpoints" / "plain" / "run"
HF_DIRECTORIES = {
    "models/hf_save.py",
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


# -- saving through the trainer: async checkpoints and failed saves ------------------------------


def _tensors(step_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    loaded = ck.load_checkpoint(step_dir)
    return {"model": loaded.model, "optimizer": loaded.optimizer}


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Bitwise the same tensors and trainer state (data position, RNG, schedule)."""
    ta, tb = _tensors(a), _tensors(b)
    for part in ("model", "optimizer"):
        assert set(ta[part]) == set(tb[part]) and ta[part]
        for name, value in ta[part].items():
            np.testing.assert_array_equal(value, tb[part][name], err_msg=f"{a.name} {name}")
    sa, sb = (ck.load_checkpoint(p).state for p in (a, b))
    assert sa == sb


def test_async_checkpoints_equal_sync_ones_and_resume_bitwise(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    sync = tiny_cfg(tmp_path / "sync", checkpoint={"every": 2, "keep_last": 3})
    fit(sync)
    every = {"every": 2, "keep_last": 3, "async": True}
    cfg = tiny_cfg(tmp_path / "async", checkpoint=every)
    _, result, out = fit(cfg)
    root, want = Path(cfg.run.output_dir) / "checkpoints", Path(sync.run.output_dir) / "checkpoints"
    assert [s for s, _ in ck.list_checkpoints(root)] == [2, 4, 6]
    for step in (2, 4, 6):
        _assert_same_checkpoint(root / f"step_{step}", want / f"step_{step}")
        assert f"saved checkpoint {root / f'step_{step}'}" in out
    records = read_metrics(cfg.run.output_dir)
    stalls = {r["step"]: r.get("checkpoint/stall_s") for r in records}
    assert all(stalls[s] is not None and stalls[s] >= 0 for s in (2, 4, 6)), stalls
    assert records[-1]["checkpoint/saved_step"] == 6  # the last save settles before the end
    committed = [r["checkpoint/saved_step"] for r in records if "checkpoint/saved_step" in r]
    assert committed == [2, 4, 6]
    assert all("checkpoint/stall_s" in r for r in read_metrics(sync.run.output_dir)
               if r["step"] % 2 == 0)  # fmt: skip
    # a crash after step 5 lost step 6: the run resumes from step 4 and ends bitwise equal
    shutil.rmtree(root / "step_6")
    _, again, out = fit(cfg)
    assert again.start_step == 4 and f"resumed from {root / 'step_4'} at step 4" in out
    _assert_same_checkpoint(root / "step_6", want / "step_6")
    assert losses(cfg) == losses(sync)
    assert result.final_step == again.final_step == 6


def test_a_failed_save_is_survived_and_the_next_one_retries(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.ENV_FAULT, "save_eio@step2,save_enospc@step6")
    cfg = tiny_cfg(tmp_path, checkpoint={"every": 2, "async": True})
    _, result, out = fit(cfg)
    assert result.final_step == 6  # training went on past both failures
    root = Path(cfg.run.output_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_4"]  # no .tmp, nothing pruned
    assert "warning: checkpoint step 2 was not saved: rank 0: EIO (Input/output error)" in out
    assert "checkpoint step 6 was not saved: rank 0: ENOSPC" in out
    assert "The newest checkpoint is still step_4 (nothing pruned)" in out
    failed = [r["checkpoint/failed_step"] for r in read_metrics(cfg.run.output_dir)
              if "checkpoint/failed_step" in r]  # fmt: skip
    assert failed == [2, 6]
    # a failed save costs nothing: the run's losses are those of a run without faults
    monkeypatch.delenv(faults.ENV_FAULT)
    clean = tiny_cfg(tmp_path / "clean", checkpoint={"every": 2})
    fit(clean)
    assert losses(cfg) == losses(clean)
    _assert_same_checkpoint(root / "step_4", Path(clean.run.output_dir) / "checkpoints/step_4")


def test_fail_on_error_stops_the_run(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.ENV_FAULT, "save_eacces@step4")
    cfg = tiny_cfg(tmp_path, checkpoint={"every": 2, "fail_on_error": True})
    with pytest.raises(SaveError, match=r"checkpoint step 4 was not saved: rank 0: EACCES"):
        fit(cfg)
    root = Path(cfg.run.output_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]
    assert len(read_metrics(cfg.run.output_dir)) == 3  # the failing step's record is not written
