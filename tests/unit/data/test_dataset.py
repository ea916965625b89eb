"""Records and documents (`flashcp.data.dataset`): JSON Lines errors name the line, the shipped
corpus, reading records, SFT documents that target only the response."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp.config import IGNORE_INDEX
from flashcp.data import (
    BUILTIN_CORPUS,
    ByteTokenizer,
    Document,
    collate,
    read_records,
    tokenize_records,
)


def test_jsonl_errors_name_the_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "f.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text" "b"}\n')
    with pytest.raises(ValueError) as info:
        read_records(bad)
    assert str(info.value) == (f"{bad}:3: not valid JSON: Expecting ':' delimiter at column 9")
    bad.write_text("[1, 2]\n")  # a JSON array of numbers: elements that are no records
    with pytest.raises(ValueError, match=rf"{bad}:1: not a JSON object: got int"):
        read_records(bad)
    bad.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: not a JSON object: got list"):
        read_records(bad)
    with pytest.raises(ValueError, match="record 1: missing field 'text'.*set data.text_field"):
        tokenize_records([{"body": "x"}], ByteTokenizer())
    with pytest.raises(ValueError, match="record 2: empty text"):
        tokenize_records([{"text": "a"}, {"text": ""}], ByteTokenizer())
    with pytest.raises(ValueError, match="data: no records"):
        tokenize_records([], ByteTokenizer())


def test_default_corpus_is_shipped_and_clean() -> None:
    records = read_records(BUILTIN_CORPUS)
    assert len(records) >= 200
    texts = [r["text"] for r in records]
    assert len(set(texts)) == len(texts) and all(len(t) > 80 for t in texts)
    assert BUILTIN_CORPUS.read_text(encoding="utf-8").count("\n") == len(records)


def test_read_records_from_file(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["ab", "cd"]) + "\n\n")
    assert read_records(path) == [{"text": "ab"}, {"text": "cd"}]


def test_sft_documents_only_target_the_response() -> None:
    tok = ByteTokenizer()
    (doc,) = tokenize_records([{"prompt": "Q?", "response": "A."}], tok, recipe="sft")
    assert doc.tokens.tolist() == [256, *b"Q?", *b"A.", 257]
    assert doc.targets.tolist() == [False, False, False, True, True, True]
    seq = collate([_seq_of(doc)]).labels[0].tolist()
    # labels[i] predicts token i+1: only positions whose next token is a response token
    assert seq == [IGNORE_INDEX, IGNORE_INDEX, ord("A"), ord("."), 257, IGNORE_INDEX]


def _seq_of(doc: Document):  # one document as its own sequence
    from flashcp.data import PackedSequence

    return PackedSequence(doc.tokens, doc.targets, [len(doc)])
