"""A researcher's path in one process, per GLM architecture: a test-sized Hugging Face directory
(tiny GLM-4 / GLM-4.5 MoE weights + config.json + a generated tokenizer with a GLM-4-style chat
template) → `model.from_pretrained` → SFT on messages → export → DPO on preference messages
from that export → export → reload with identical logits and the same tokenizer."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp import dispatch, masks
from flashcp.config import build_config
from flashcp.data import HFTokenizer
from flashcp.models import AttentionContext, build_model, preset
from flashcp.models.hf_config import hf_config
from flashcp.models.hf_weights import save_hf_checkpoint
from flashcp.trainer import Trainer, read_metrics
from flashcp.trainer.export import export_run
from flashcp.trainer.loop import default_model_factory
from hfdir import (
    DEFAULT_VOCAB,
    chat_records,
    preference_records,
    write_jsonl,
    write_tokenizer_files,
)


@pytest.fixture(autouse=True)
def _restore_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer sets deterministic flags in os.environ; undo that after each test."""
    for name in (dispatch.FLAG_DETERMINISTIC, "FLAGS_embedding_deterministic"):
        monkeypatch.setenv(name, "0")


def _train(model_dir: Path, data: Path, out: Path, recipe: str, **extra: Any) -> Trainer:
    raw: dict[str, Any] = {
        "model": {"from_pretrained": str(model_dir)},
        "data": {"path": str(data), "seq_len": 128, "micro_batch_size": 2},
        "train": {"steps": 8, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "seed": 1},
        "checkpoint": {"every": 8},
        "run": {"recipe": recipe, "output_dir": str(out), "device": "cpu"},
    }
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    cfg = build_config(raw)
    assert cfg.data.tokenizer == str(model_dir)  # the directory's tokenizer by default
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.fit()
    return trainer


def _logits(model: paddle.nn.Layer, ids: np.ndarray) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=masks.causal_mask(b, s).indices, causal=True)
    with paddle.no_grad():
        return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


@pytest.mark.parametrize("name", ["tiny_glm", "tiny_glm_moe"])
def test_directory_sft_dpo_export_reload(tmp_path: Path, name: str) -> None:
    args = preset(name, vocab_size=DEFAULT_VOCAB, max_seq_len=256)
    base = tmp_path / "base"
    save_hf_checkpoint(build_model(args, seed=5), base)
    (base / "config.json").write_text(json.dumps(hf_config(args), indent=1))
    write_tokenizer_files(base)
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(24))
    prefs = write_jsonl(tmp_path / "pref.jsonl", preference_records(24, as_messages=True))

    _train(base, chat, tmp_path / "sft", "sft")
    sft_losses = [r["loss"] for r in read_metrics(tmp_path / "sft")]
    assert np.mean(sft_losses[-2:]) < np.mean(sft_losses[:2]) - 0.3, sft_losses
    sft_hf = tmp_path / "sft_hf"
    report = export_run(tmp_path / "sft", sft_hf)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(report.tokenizer_files)

    dpo = _train(
        sft_hf,
        prefs,
        tmp_path / "dpo",
        "dpo",
        dpo={"beta": 0.1},
        train={"steps": 12, "lr": 1e-3, "min_lr": 1e-4},
        checkpoint={"every": 12},
    )
    dpo_losses = [r["loss"] for r in read_metrics(tmp_path / "dpo")]
    assert dpo_losses[0] == pytest.approx(math.log(2))  # policy == reference (the SFT model)
    assert np.mean(dpo_losses[-3:]) < math.log(2) - 0.05, dpo_losses
    final = tmp_path / "final_hf"
    export_run(tmp_path / "dpo", final)

    reloaded = default_model_factory(
        build_config({"model": {"from_pretrained": str(final)}, "data": {"seq_len": 32}})
    )
    ids = np.random.default_rng(0).integers(0, DEFAULT_VOCAB, (2, 24))
    np.testing.assert_array_equal(_logits(reloaded, ids), _logits(dpo.model, ids))
    conv = chat_records(2)[1]["messages"]
    assert HFTokenizer(final).render_chat(conv) == HFTokenizer(base).render_chat(conv)
    assert HFTokenizer(final).encode("[gMASK]<sop>") == HFTokenizer(base).encode("[gMASK]<sop>")
