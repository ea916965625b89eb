"""`flashcp export` of a run trained from scratch loads in transformers (issue 21, the export).

Such a run has no starting config.json to copy token ids from, and its export used to write
none: transformers 5.x then filled in GLM's defaults (151329...), which a small vocabulary
refuses (`Padding_idx must be within num_embeddings`), and the byte tokenizer left no tokenizer
files. Now config.json records the ids the run's tokenizer gave the data (explicit nulls where
it has none, or cannot be loaded at export time) and the byte tokenizer is written as a Hugging
Face tokenizer directory with the same ids. transformers' `AutoConfig` / `AutoTokenizer` need
no PyTorch, so they are checked here; the model itself loads in the hf tier
(`tests/hf/test_hf_reference.py::test_transformers_loads_a_from_scratch_export`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from flashcp.checkpoint.export import export_run, run_token_ids
from flashcp.config import build_config
from flashcp.data.tokenizer import ByteTokenizer, build_tokenizer
from flashcp.trainer import Trainer

TEXT = "Grüße, 世界! ✓ 😀\n\ttabs and spaces  "
BYTE_IDS = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}


def _transformers() -> Any:
    """transformers, imported on use (its tokenizers and configs need no PyTorch)."""
    import transformers

    return transformers


def _scratch_run(tmp: Path, tokenizer: str = "byte", **sections: dict[str, Any]) -> Path:
    raw: dict[str, Any] = {
        "model": {"preset": "tiny_glm", "max_seq_len": 64},
        "data": {"seq_len": 32, "micro_batch_size": 2, "tokenizer": tokenizer},
        "train": {"steps": 1, "lr": 3e-3, "warmup_steps": 0, "seed": 3},
        "checkpoint": {"every": 1},
        "run": {"output_dir": str(tmp / "run"), "device": "cpu"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    Trainer(build_config(raw), stream=io.StringIO()).fit()
    return tmp / "run"


def test_byte_tokenizer_directory_gives_the_byte_ids(tmp_path: Path) -> None:
    files = ByteTokenizer().save_pretrained(tmp_path)
    assert files == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    byte = ByteTokenizer()
    want = byte.encode(TEXT)
    ours = build_tokenizer(str(tmp_path))  # flashcp reading it as an HF directory
    assert ours.encode(TEXT) == want and ours.decode(want) == TEXT
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (256, 257, 258)
    hf = _transformers().AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(TEXT, add_special_tokens=False)["input_ids"] == want
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
    assert hf.decode([256, *want, 257], skip_special_tokens=True) == TEXT
    assert len(hf) == byte.vocab_size


def test_scratch_export_records_the_runs_token_ids_and_tokenizer(tmp_path: Path) -> None:
    run = _scratch_run(tmp_path)
    out = tmp_path / "export"
    report = export_run(run, out)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in BYTE_IDS} == BYTE_IDS
    assert json.loads((out / "generation_config.json").read_text()) == BYTE_IDS
    assert report.tokenizer_files == ["tokenizer.json", "tokenizer_config.json",
                                      "special_tokens_map.json"]  # fmt: skip
    tf = _transformers()
    loaded = tf.AutoConfig.from_pretrained(str(out))
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (256, 257, 258)
    assert loaded.pad_token_id < loaded.vocab_size
    tok = tf.AutoTokenizer.from_pretrained(str(out))
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(TEXT)

    # negative control: without the ids (the export before), transformers fills in GLM's
    for key in BYTE_IDS:
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    default = tf.AutoConfig.from_pretrained(str(out))
    assert default.pad_token_id is not None and default.pad_token_id >= default.vocab_size


def _tokenizer_dir(tmp: Path) -> Path:
    """An HF tokenizer directory with EOS and PAD but no BOS (a byte vocabulary, renamed)."""
    directory = tmp / "tok"
    directory.mkdir()
    ByteTokenizer().save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["bos_token"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").unlink()
    return directory


def test_a_missing_token_is_an_explicit_null(tmp_path: Path) -> None:
    directory = _tokenizer_dir(tmp_path)
    run = _scratch_run(tmp_path, str(directory))
    out = tmp_path / "export"
    export_run(run, out)
    config = json.loads((out / "config.json").read_text())
    assert "bos_token_id" in config and config["bos_token_id"] is None  # not GLM's default
    assert (config["eos_token_id"], config["pad_token_id"]) == (257, 258)
    loaded = _transformers().AutoConfig.from_pretrained(str(out))
    assert loaded.bos_token_id is None and loaded.pad_token_id == 258
    assert json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": 257, "pad_token_id": 258
    }  # fmt: skip


def test_tokenizer_gone_at_export_time_writes_nulls_and_says_so(tmp_path: Path) -> None:
    directory = _tokenizer_dir(tmp_path)
    run = _scratch_run(tmp_path, str(directory))
    moved = tmp_path / "moved"
    directory.rename(moved)
    out = tmp_path / "export"
    report = export_run(run, out)
    config = json.loads((out / "config.json").read_text())
    assert all(k in config and config[k] is None for k in BYTE_IDS)
    assert not report.generation_config and not (out / "generation_config.json").exists()
    assert any("token ids written as null" in n for n in report.notes), report.notes
    assert any("no tokenizer files" in n for n in report.notes), report.notes


def test_pretrained_start_keeps_its_own_ids(tmp_path: Path) -> None:
    """A run that started from an HF directory records that directory's ids, as before (an
    absent key stays absent: the original model's defaults apply)."""
    start = tmp_path / "start"
    start.mkdir()
    (start / "config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    cfg = build_config({"model": {"preset": "tiny_glm"}, "data": {"tokenizer": "byte"},
                        "checkpoint": {"init_from": str(start)}}, check=False)  # fmt: skip
    assert run_token_ids(cfg) == {"eos_token_id": [5, 6]}


def test_merged_lora_export_of_a_scratch_run_has_the_ids(tmp_path: Path) -> None:
    lora = {"rank": 4, "target_modules": [".*q_proj"], "merge_at_end": True}
    run = _scratch_run(tmp_path, run={"recipe": "sft"}, lora=lora)
    config = json.loads((run / "merged" / "config.json").read_text())
    assert {k: config[k] for k in BYTE_IDS} == BYTE_IDS
