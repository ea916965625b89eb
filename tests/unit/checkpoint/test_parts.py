"""Checkpoints written in parts (one per pipeline stage): commit, verify, load, prune."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flashcp.checkpoint import format as ckpt
from flashcp.checkpoint import parts as sharded
from helpers.checkpoints import save_stages


def _write(root: Path, step: int, value: float, *, keep_last: int | None = None) -> Path:
    shared = {"model.embed_tokens.weight": np.full((2, 2), value, dtype=np.float32)}
    models = [{f"model.layers.{s}.w": np.full(3, value + s), **shared} for s in range(2)]
    optimizers = [{f"model.layers.{s}.w::moment1_0": np.zeros(3)} for s in range(2)]
    return save_stages(root, step, models, optimizers, state={"data": {"row": step}},
                       keep_last=keep_last)  # fmt: skip


def test_parts_merge_on_load_and_resave_replaces(tmp_path: Path) -> None:
    path = _write(tmp_path, 2, 1.0)
    assert ckpt.verify_checkpoint(path) == []
    loaded = ckpt.load_checkpoint(path)
    assert loaded.step == 2 and loaded.state["data"] == {"row": 2}
    assert sorted(loaded.model) == ["model.embed_tokens.weight", "model.layers.0.w",
                                    "model.layers.1.w"]  # fmt: skip
    assert float(loaded.model["model.layers.1.w"][0]) == 2.0
    assert len(loaded.optimizer) == 2
    again = _write(tmp_path, 2, 5.0)  # the same step again: swapped in atomically
    assert float(ckpt.load_checkpoint(again).model["model.layers.0.w"][0]) == 5.0
    assert not (tmp_path / "step_2.old").exists() and not (tmp_path / "step_2.tmp").exists()


def test_a_damaged_part_is_refused_and_skipped(tmp_path: Path) -> None:
    _write(tmp_path, 1, 1.0)
    newest = _write(tmp_path, 2, 2.0)
    part = newest / "model-00002-of-00002.safetensors"
    part.write_bytes(part.read_bytes()[:50])
    problems = ckpt.verify_checkpoint(newest)
    assert any("model-00002-of-00002.safetensors" in p and "truncated" in p for p in problems)
    with pytest.raises(ckpt.CheckpointError, match="broken and was not loaded"):
        ckpt.load_checkpoint(newest)
    assert ckpt.latest_checkpoint(tmp_path, warn=False) == tmp_path / "step_1"
    (newest / "optimizer-00001-of-00002.safetensors").unlink()
    assert any("is missing" in p for p in ckpt.verify_checkpoint(newest))


def test_part_names_and_pruning(tmp_path: Path) -> None:
    model, _ = sharded.part_names(2, adapters=True)
    assert model[1] == "adapters/peft_model-00002-of-00002.safetensors"
    assert sharded.part_names(2, adapters=False) == (
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        ["optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"],
    )
    assert sharded.shard_names(2, 3)[1][2] == (
        "optimizer-00002-of-00002.shard-00003-of-00003.safetensors"
    )
    tmp = sharded.begin(tmp_path, 3, adapters=True)
    assert (tmp / sharded.ADAPTER_DIR).is_dir()
    for step in (4, 5, 6):
        _write(tmp_path, step, float(step), keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5, 6]
