"""Chat data in a launched job: two dp ranks index a Parquet file of conversations together
(each its share, all-gathered over gloo), build only their own sequences, and train exactly
like one process on the same conversations from JSON Lines (float32 rule, `trainruns`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.hfdir import (
    DEFAULT_VOCAB,
    chat_records,
    write_jsonl,
    write_parquet,
    write_tokenizer_files,
)
from flashcp.config import build_config
from flashcp.trainer import Trainer
from helpers.launch import run_launch
from helpers.paths import ROOT
from helpers.trainruns import assert_training_matches

pytestmark = pytest.mark.integration

TRAIN = ROOT / "src" / "flashcp" / "train.py"
STEPS = 4


def _raw(tok: Path, data: Path, out: Path) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny_glm", "vocab_size": DEFAULT_VOCAB},
        "data": {"tokenizer": str(tok), "path": str(data), "seq_len": 128,
                 "micro_batch_size": 2},  # fmt: skip
        "train": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every": 0},
        "debug": {"dump_grads": True},
        "run": {"recipe": "sft", "output_dir": str(out)},
    }


def _in_process(raw: dict[str, Any]) -> None:
    Trainer(build_config(raw)).fit()


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_dp2_sft_on_parquet_messages_matches_one_process(tmp_path: Path) -> None:
    tok = write_tokenizer_files(tmp_path / "tok")
    records: list[dict[str, Any]] = chat_records(30)
    records.insert(7, {"messages": None})  # a bad record both ranks must agree to skip
    jsonl = write_jsonl(tmp_path / "chat.jsonl", records)
    parquet = write_parquet(tmp_path / "chat.parquet", records)
    ref = tmp_path / "ref"
    _in_process(_raw(tok, jsonl, ref))
    raw = _raw(tok, parquet, tmp_path / "run")
    raw["parallel"] = {"dp": 2}
    raw["data"].update(micro_batch_size=1, cache_dir=str(tmp_path / "cache"))
    config = tmp_path / "dp2.yaml"
    config.write_text(yaml.safe_dump(raw))
    result = run_launch(TRAIN, 2, ["--config", str(config)], timeout=180, log_dir=tmp_path / "logs")
    assert result.ok, result.summary()
    assert_training_matches(tmp_path / "run", ref, steps=STEPS)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())["data"]
    assert info["rows"] == 31 and info["documents"] == 30
    assert info["bad_records"]["reasons"] == {
        "missing field 'messages'": {"count": 1, "first": [f"{parquet} row 7"]}
    }
