"""Checkpoint files (`flashcp.checkpoint.format`): atomic writes, checksum verification,
keep-last."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from flashcp.checkpoint import format as ck
from helpers.checkpoints import save_checkpoint


def _save(root: Path, step: int, keep_last: int | None = None) -> Path:
    rng = np.random.default_rng(step)
    return save_checkpoint(
        root,
        step,
        model={"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.arange(3.0)},
        optimizer={"w::moment1_0": np.zeros((4, 3), np.float32)},
        state={"data": {"epoch": 1}, "note": "x"},
        keep_last=keep_last,
    )


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    assert path == tmp_path / "step_3"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [ck.MODEL_FILE, ck.OPTIMIZER_FILE, ck.STATE_FILE, ck.MANIFEST_FILE]
    )
    assert not list(tmp_path.glob("*.tmp"))
    manifest = json.loads((path / ck.MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {ck.MODEL_FILE, ck.OPTIMIZER_FILE, ck.STATE_FILE}
    loaded = ck.load_checkpoint(path)
    assert loaded.step == 3 and loaded.state["data"] == {"epoch": 1}
    np.testing.assert_array_equal(loaded.model["b"], np.arange(3.0))
    assert loaded.model["w"].dtype == np.float32
    assert ck.verify_checkpoint(path) == []


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    data = (path / ck.MODEL_FILE).read_bytes()
    (path / ck.MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointError, match=r"model.safetensors has \d+ bytes.*truncated"):
        ck.load_checkpoint(path)


def test_flipped_byte_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    blob = bytearray((path / ck.OPTIMIZER_FILE).read_bytes())
    blob[-1] ^= 0xFF
    (path / ck.OPTIMIZER_FILE).write_bytes(bytes(blob))
    with pytest.raises(ck.CheckpointError, match="optimizer.safetensors does not match its sha256"):
        ck.load_checkpoint(path)


def test_missing_pieces_are_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    (path / ck.STATE_FILE).unlink()
    assert ck.verify_checkpoint(path) == ["trainer_state.json is missing"]
    (path / ck.MANIFEST_FILE).unlink()
    with pytest.raises(ck.CheckpointError, match="manifest.json is missing"):
        ck.load_checkpoint(path)
    (path / ck.MANIFEST_FILE).write_text("{not json")
    assert "unreadable" in ck.verify_checkpoint(path)[0]
    assert "not a directory" in ck.verify_checkpoint(tmp_path / "nope")[0]


def test_latest_skips_broken_and_interrupted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    (newest / ck.MODEL_FILE).write_bytes(b"garbage")
    (tmp_path / "step_6.tmp").mkdir()  # a save that crashed before its rename
    (tmp_path / "step_6.tmp" / ck.MODEL_FILE).write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert "skipping broken checkpoint" in caplog.text and "step 4" in caplog.text
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 4]
    assert ck.latest_checkpoint(tmp_path / "none") is None


def test_keep_last_prunes_oldest_and_stale_dirs(tmp_path: Path) -> None:
    (tmp_path / "step_9.tmp").mkdir(parents=True)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert not (tmp_path / "step_9.tmp").exists()


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    again = save_checkpoint(tmp_path, 5, model={"w": np.ones(2)}, optimizer={}, state={})
    assert ck.load_checkpoint(again).model["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]
