"""`checkpoint.init_from`: training starts from HF-layout safetensors weights, validated first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

from flashcp.config import load_config
from flashcp.models import build_model
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.parallelize import default_model_factory
from flashcp.problems import ProblemsError
from helpers.paths import ROOT

CONFIG = ROOT / "configs" / "glm" / "tiny_cp2.yaml"


def _weights(model: paddle.nn.Layer) -> dict[str, np.ndarray]:
    return {name: p.numpy().copy() for name, p in model.named_parameters()}


def test_model_starts_from_the_checkpoint(tmp_path: Path) -> None:
    base = load_config(CONFIG, [f"run.output_dir={tmp_path / 'a'}"], world_size=2)
    paddle.seed(123)
    source = build_model(base.model)
    save_hf_checkpoint(source, tmp_path / "init")
    cfg = load_config(
        CONFIG,
        [f"checkpoint.init_from={tmp_path / 'init'}", f"run.output_dir={tmp_path / 'b'}"],
        world_size=2,
    )
    paddle.seed(0)  # what the trainer seeds with: without init_from this gives other weights
    loaded = _weights(default_model_factory(cfg))
    paddle.seed(0)
    seeded = _weights(default_model_factory(base))
    want = _weights(source)
    assert loaded.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(loaded[name], want[name], err_msg=name)
    assert any(not np.array_equal(seeded[n], want[n]) for n in want)


def test_init_from_draws_no_initial_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `checkpoint.init_from` every parameter is read from the checkpoint, so the build
    draws none of them first (a real-size stage would spend minutes on host random numbers);
    a missing parameter is still an error, never a silently zero weight."""
    import flashcp.models.build as models

    base = load_config(CONFIG, [f"run.output_dir={tmp_path / 'a'}"], world_size=2)
    source = build_model(base.model, seed=5)
    save_hf_checkpoint(source, tmp_path / "init")
    cfg = load_config(
        CONFIG,
        [f"checkpoint.init_from={tmp_path / 'init'}", f"run.output_dir={tmp_path / 'b'}"],
        world_size=2,
    )

    def no_draws(*args: object, **kwargs: object) -> int:
        raise AssertionError("initial values drawn although every weight is loaded")

    monkeypatch.setattr(models, "init_parameters", no_draws)
    loaded = _weights(default_model_factory(cfg))
    want = _weights(source)
    for name in want:
        np.testing.assert_array_equal(loaded[name], want[name], err_msg=name)
    with pytest.raises(AssertionError, match="initial values drawn"):
        default_model_factory(base)  # without init_from the values are drawn
    # a checkpoint lacking a parameter is refused before anything is read
    from safetensors.numpy import load_file, save_file

    state = load_file(str(tmp_path / "init" / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "init" / "model.safetensors"))
    from flashcp.models.hf_check import CheckpointMismatchError

    with pytest.raises(CheckpointMismatchError, match="model.norm.weight"):
        default_model_factory(cfg)


def test_missing_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ProblemsError) as info:
        load_config(CONFIG, [f"checkpoint.init_from={tmp_path / 'nope'}"], world_size=2)
    assert "checkpoint.init_from" in str(info.value) and "no checkpoint at" in str(info.value)
