"""Tokenizers (`flashcp.data.tokenizer`): the byte tokenizer, `tokenizer.json` files and their
checks against the model's vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashcp.config import build_config
from flashcp.data import ByteTokenizer, HFTokenizer, TrainData, build_tokenizer, tokenize_records


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "Grüße, 世界! \n\t"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def _tiny_tokenizer_json(path: Path, *, with_eos: bool = True) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5, ".": 6}
    if with_eos:
        vocab["<|endoftext|>"] = 7
        vocab["<pad>"] = 8
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    if with_eos:
        tok.add_special_tokens(["<|endoftext|>", "<pad>"])
    tok.save(str(path))
    return path


def test_hf_tokenizer_json(tmp_path: Path) -> None:
    path = _tiny_tokenizer_json(tmp_path / "tokenizer.json")
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("the cat sat on the mat.") == [1, 2, 3, 4, 1, 5, 6]
    assert tok.encode("the dog") == [1, 0]
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (7, 8, None, 9)
    assert tok.decode([1, 2, 7]) == "the cat"
    docs = tokenize_records([{"text": "the cat"}], tok)
    assert docs[0].tokens.tolist() == [1, 2, 7]  # no BOS in this vocabulary


def test_hf_tokenizer_needs_eos(tmp_path: Path) -> None:
    path = _tiny_tokenizer_json(tmp_path / "tokenizer.json", with_eos=False)
    with pytest.raises(ValueError, match="no end-of-text token"):
        HFTokenizer(path)
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        HFTokenizer(tmp_path / "missing.json")


def test_tokenizer_too_large_for_model(tmp_path: Path) -> None:
    path = _tiny_tokenizer_json(tmp_path / "tokenizer.json")
    cfg = build_config(
        {"model": {"preset": "tiny", "vocab_size": 260}, "data": {"seq_len": 16}}
    )
    data = TrainData(cfg, tokenizer=HFTokenizer(path))
    assert data.tokenizer.vocab_size == 9
    small = build_config({"model": {"preset": "tiny", "vocab_size": 8}, "data": {"tokenizer":
                          str(path), "seq_len": 16}})  # fmt: skip
    with pytest.raises(ValueError, match="set model.vocab_size >= 9"):
        TrainData(small)
