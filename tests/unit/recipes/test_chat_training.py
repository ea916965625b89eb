"""End to end in one process: a tiny GLM trained with a real tokenizer directory (GLM-4-style
chat template) on messages JSONL (sft) and on preference messages (dpo). It learns, the start
line and run_info.json report the skipped bad record, and a resumed run matches."""

from __future__ import annotations

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
from helpers.configs import TINY_GLM, TINY_LM, Sections, TinyCfg, merged
from helpers.trainruns import Fit


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("glm_tok"))


@pytest.fixture
def tiny_base(tok_dir: Path) -> Sections:
    """The tiny GLM with the tokenizer directory's vocabulary, two rows per micro-batch, 20
    steps."""
    return merged(
        TINY_GLM,
        model={"vocab_size": DEFAULT_VOCAB},
        data={"tokenizer": str(tok_dir), "micro_batch_size": 2},
        train={**TINY_LM["train"], "steps": 20},
    )


def test_sft_on_messages_learns_and_reports_bad_records(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    records: list[Any] = chat_records(40)
    records.insert(5, {"messages": [{"role": "user", "content": "no answer"}]})
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = tiny_cfg(tmp_path, data={"path": str(data)}, run={"recipe": "sft"})
    run = fit(cfg)
    metrics, out = run.records, run.out
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(DEFAULT_VOCAB), abs=0.3)  # ~uniform at init
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.8, losses
    # the targets are the assistant tokens only (their exact masks: tests/unit/data/test_chat.py)
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


def test_sft_on_messages_resumes_bitwise(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(12))
    sft = {"data": {"path": str(data)}, "train": {"steps": 6}}
    whole = fit(tiny_cfg(tmp_path / "a", **sft, run={"recipe": "sft"})).records
    part = tiny_cfg(tmp_path / "b", **sft, checkpoint={"every": 3},
                    run={"recipe": "sft", "stop_after_steps": 3})  # fmt: skip
    fit(part)
    rest = fit(tiny_cfg(tmp_path / "b", **sft, checkpoint={"every": 3}, run={"recipe": "sft"}))
    resumed, out = rest.records, rest.out
    assert "resumed from" in out
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]


def test_dpo_on_preference_messages_learns(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    data = write_jsonl(tmp_path / "pref.jsonl", preference_records(52, as_messages=True))
    cfg = tiny_cfg(
        tmp_path,
        data={"path": str(data), "seq_len": 256, "micro_batch_size": 1, "shuffle": False},
        train={"steps": 24, "grad_accum": 1},
        dpo={"beta": 0.1},
        run={"recipe": "dpo"},
    )
    run = fit(cfg)
    metrics, out = run.records, run.out
    losses = [m["loss"] for m in metrics]
    assert losses[0] == pytest.approx(math.log(2))  # policy == reference at step 1
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.05, losses
    assert np.mean([m["rewards/margin"] for m in metrics[-6:]]) > 0.0
    assert "52 preference pairs" in out
