"""Checkpoints: atomic writes, checksum verification, keep-last, and Paddle state round trips."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import paddle
import pytest

from flashcp.checkpoint import format as ck
from flashcp.checkpoint.optimizer_state import ClassicSource, classic_arrays
from flashcp.checkpoint.state import load_model_arrays, model_arrays, rng_state, set_rng_state
from flashcp.optim.adamw import adamw_state, load_adamw_state


def _save(root: Path, step: int, keep_last: int | None = None) -> Path:
    rng = np.random.default_rng(step)
    return ck.save_checkpoint(
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
    again = ck.save_checkpoint(tmp_path, 5, model={"w": np.ones(2)}, optimizer={}, state={})
    assert ck.load_checkpoint(again).model["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]


# -- Paddle state ------------------------------------------------------------------------------


def _net() -> paddle.nn.Layer:
    nn = paddle.nn
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _step(model: paddle.nn.Layer, opt: paddle.optimizer.Optimizer, x: paddle.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.clear_grad()


def test_model_and_optimizer_state_move_between_fresh_models() -> None:
    paddle.seed(0)
    x = paddle.randn([5, 4])
    a = _net()
    opt_a = paddle.optimizer.AdamW(learning_rate=0.01, parameters=a.parameters())
    for _ in range(3):
        _step(a, opt_a, x)
    pieces = adamw_state(opt_a, [(p, n, 0) for n, p in a.named_parameters()])
    model_state, opt_state = model_arrays(a), classic_arrays(pieces)
    assert any(k.endswith("::moment1_0") for k in opt_state)
    assert all(not k.startswith("linear_") for k in opt_state)  # structured names only
    b = _net()  # Paddle gives its tensors new names
    opt_b = paddle.optimizer.AdamW(learning_rate=0.01, parameters=b.parameters())
    load_model_arrays(b, model_state)
    load_adamw_state(opt_b, [(p, n, 0) for n, p in b.named_parameters()], ClassicSource(opt_state))
    _step(a, opt_a, x)
    _step(b, opt_b, x)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=name)


def test_mismatched_model_state_is_refused() -> None:
    state = model_arrays(_net())
    with pytest.raises(ValueError, match="missing"):
        load_model_arrays(_net(), {k: v for k, v in state.items() if k != "0.weight"})
    bad = dict(state)
    bad["0.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="has shape"):
        load_model_arrays(_net(), bad)


def test_rng_state_round_trip() -> None:
    paddle.seed(11)
    np.random.seed(11)
    random.seed(11)
    state = json.loads(json.dumps(rng_state()))
    assert state["paddle"]["generators"][0]["seed"] == 11
    want = (paddle.randn([3]).numpy(), np.random.rand(3), random.random())
    paddle.seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_state(state)
    got = (paddle.randn([3]).numpy(), np.random.rand(3), random.random())
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]
