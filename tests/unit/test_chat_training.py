"""End to end in one process: a tiny GLM trained with a real tokenizer directory (GLM-4-style
chat template) on messages JSONL (sft) and on preference messages (dpo). It learns, the start
line and run_info.json report the skipped bad record, and a resumed run matches."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.hfdir import (
    DEFAULT_VOCAB,
    chat_records,
    preference_records,
    write_jsonl,
    write_tokenizer_files,
)
from flashcp import dispatch
from flashcp.config import build_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer


@pytest.fixture(autouse=True)
def _restore_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer sets deterministic flags in os.environ; undo that after each test."""
    for name in (dispatch.FLAG_DETERMINISTIC, "FLAGS_embedding_deterministic"):
        monkeypatch.setenv(name, "0")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("glm_tok"))


def _cfg(tmp: Path, tok_dir: Path, path: Path, recipe: str, **sections: dict[str, Any]) -> Any:
    raw: dict[str, Any] = {
        "model": {"preset": "tiny_glm", "vocab_size": DEFAULT_VOCAB},
        "data": {"tokenizer": str(tok_dir), "path": str(path), "seq_len": 128,
                 "micro_batch_size": 2},  # fmt: skip
        "train": {"steps": 20, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "seed": 0},
        "run": {"recipe": recipe, "output_dir": str(tmp / "run")},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw)


def _fit(cfg: Any) -> tuple[list[dict[str, Any]], str]:
    out = io.StringIO()
    Trainer(cfg, stream=out).fit()
    return read_metrics(cfg.run.output_dir), out.getvalue()


def test_sft_on_messages_learns_and_reports_bad_records(tmp_path: Path, tok_dir: Path) -> None:
    records: list[Any] = chat_records(40)
    records.insert(5, {"messages": [{"role": "user", "content": "no answer"}]})
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = _cfg(tmp_path, tok_dir, data, "sft")
    metrics, out = _fit(cfg)
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(DEFAULT_VOCAB), abs=0.3)  # ~uniform at init
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.8, losses
    # the targets are the assistant tokens only (their exact masks: tests/unit/test_chat_data.py)
    assert all(0 < m["targets"] < 0.75 * m["tokens"] for m in metrics)
    assert (
        f"1 bad record skipped: conversation does not end with an assistant turn ×1 "
        f"({data}:6)" in out
    )
    info = json.loads((Path(cfg.run.output_dir) / "run_info.json").read_text())
    assert info["data"]["rows"] == 41 and info["data"]["documents"] == 40
    assert info["data"]["bad_records"] == {
        "skipped": 1,
        "reasons": {
            "conversation does not end with an assistant turn": {
                "count": 1,
                "first": [f"{data}:6"],
            }
        },
    }


def test_sft_on_messages_resumes_bitwise(tmp_path: Path, tok_dir: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(12))
    short = {"steps": 6}
    whole, _ = _fit(_cfg(tmp_path / "a", tok_dir, data, "sft", train=short))
    part = _cfg(tmp_path / "b", tok_dir, data, "sft", train=short,
                checkpoint={"every": 3}, run={"stop_after_steps": 3})  # fmt: skip
    _fit(part)
    rest = _cfg(tmp_path / "b", tok_dir, data, "sft", train=short, checkpoint={"every": 3})
    resumed, out = _fit(rest)
    assert "resumed from" in out
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]


def test_dpo_on_preference_messages_learns(tmp_path: Path, tok_dir: Path) -> None:
    data = write_jsonl(tmp_path / "pref.jsonl", preference_records(52, as_messages=True))
    cfg = _cfg(
        tmp_path,
        tok_dir,
        data,
        "dpo",
        data={"seq_len": 256, "micro_batch_size": 1, "shuffle": False},
        train={"steps": 24, "grad_accum": 1},
        dpo={"beta": 0.1},
    )
    metrics, out = _fit(cfg)
    losses = [m["loss"] for m in metrics]
    assert losses[0] == pytest.approx(math.log(2))  # policy == reference at step 1
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.05, losses
    assert np.mean([m["rewards/margin"] for m in metrics[-6:]]) > 0.0
    assert "52 preference pairs" in out
