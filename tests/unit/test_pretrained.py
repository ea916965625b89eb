"""`flashcp.from_pretrained`: a Hugging Face directory of each family, written by flashcp's
exporter, read back as the same model (logits bitwise: same layout, same order), one pipeline
stage of it holding exactly that stage's tensors, and a key that would change the model
refused before anything is built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

import flashcp
from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.models import build_model, preset
from flashcp.models.hf_save import save_hf_checkpoint


def _logits(model, ids: np.ndarray) -> np.ndarray:
    pos = paddle.arange(ids.shape[1], dtype="int64").unsqueeze(0)
    ctx = AttentionContext(mask=masks.causal_mask(1, ids.shape[1]).indices, causal=True)
    with paddle.no_grad():
        return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


@pytest.mark.parametrize("name", ["tiny_ernie_moe", "tiny_llama", "tiny_qwen3_moe", "tiny_qwen2"])
def test_from_pretrained_reads_back_the_saved_model(name: str, tmp_path: Path) -> None:
    original = build_model(preset(name), seed=3)
    save_hf_checkpoint(original, tmp_path)
    model = flashcp.from_pretrained(tmp_path)
    assert model.args.arch == preset(name).arch
    ids = np.random.default_rng(0).integers(0, 250, (1, 24))
    assert np.array_equal(_logits(model, ids), _logits(original, ids))
    fresh = build_model(preset(name), seed=4)  # control: another draw differs
    assert not np.allclose(_logits(fresh, ids), _logits(original, ids))
    last = flashcp.from_pretrained(tmp_path, stage=1, num_stages=2, recompute="full")
    assert last.args.recompute == "full" and last.layer_range == range(1, 2)
    mine = dict(last.named_parameters())
    whole = dict(original.named_parameters())
    assert set(mine) < set(whole)
    for key, value in mine.items():
        assert np.array_equal(value.numpy(), whole[key].numpy()), key


def test_a_key_that_changes_the_model_is_refused(tmp_path: Path) -> None:
    save_hf_checkpoint(build_model(preset("tiny_qwen3"), seed=0), tmp_path)
    with pytest.raises(TypeError, match="hidden_size would change the model config.json"):
        flashcp.from_pretrained(tmp_path, hidden_size=128)
