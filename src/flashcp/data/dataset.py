"""Documents: JSONL records → token arrays with a per-token "is a training target" flag.

A pretrain document is `[BOS] text [EOS]`, every token after the first a target. An SFT
document is `[BOS] prompt response [EOS]` where only the response tokens and the EOS are
targets (the model is not trained to produce the prompt). The flags travel with the tokens
through packing, and `flashcp.data.packing.shift_labels` turns them into labels.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.data.tokenizer import Tokenizer

DEFAULT_CORPUS = "default_corpus.jsonl"
"""The small English corpus shipped inside the package (used when data.path is null)."""
DPO_DEFAULT = "dpo_default.jsonl"
"""The small preference set shipped inside the package (prompt / chosen / rejected)."""


@dataclass(frozen=True, eq=False)
class Document:
    """One tokenized document: `tokens` (int64 [n]) and `targets` (bool [n])."""

    tokens: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def default_corpus_text() -> str:
    """The shipped corpus as text (read from package data, works from a wheel too)."""
    return resources.files("flashcp.data").joinpath(DEFAULT_CORPUS).read_text(encoding="utf-8")


def parse_jsonl(text: str, source: str) -> Iterator[dict[str, Any]]:
    """Records of a JSONL text; `ValueError` naming `source:line` on a bad line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{source}:{number}: expected a JSON object, got {record!r:.60}")
        yield record


def builtin_sft_records(
    prompt_field: str = "prompt", response_field: str = "response"
) -> list[dict[str, Any]]:
    """The built-in instruction set: the built-in DPO preference pairs' prompts, each with its
    preferred ("chosen") answer as the response (used by the sft recipe when data.path is null)."""
    text = resources.files("flashcp.data").joinpath(DPO_DEFAULT).read_text(encoding="utf-8")
    return [
        {prompt_field: r["prompt"], response_field: r["chosen"]}
        for r in parse_jsonl(text, f"flashcp/data/{DPO_DEFAULT}")
    ]


def read_records(path: str | Path | None) -> list[dict[str, Any]]:
    """Every record of the JSONL file at `path` (None: the shipped corpus)."""
    if path is None:
        return list(parse_jsonl(default_corpus_text(), f"flashcp/data/{DEFAULT_CORPUS}"))
    p = Path(path)
    return list(parse_jsonl(p.read_text(encoding="utf-8"), str(p)))


def _field(record: dict[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if not isinstance(value, str):
        keys = ", ".join(sorted(record)) or "none"
        raise ValueError(
            f"{where}: record has no string field {name!r} (its keys: {keys}); set the "
            "data.*_field config keys to the field names your file uses"
        )
    return value


def _document(tokenizer: Tokenizer, parts: Sequence[tuple[str, bool]]) -> Document | None:
    tokens: list[int] = []
    targets: list[bool] = []
    if tokenizer.bos_id is not None:
        tokens.append(tokenizer.bos_id)
        targets.append(False)
    for text, is_target in parts:
        ids = tokenizer.encode(text)
        tokens += ids
        targets += [is_target] * len(ids)
    if not any(targets):
        return None  # nothing to learn from (empty text or empty response)
    tokens.append(tokenizer.eos_id)
    targets.append(True)
    if len(tokens) < 2:
        return None
    return Document(np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=bool))


def tokenize_records(
    records: Sequence[dict[str, Any]],
    tokenizer: Tokenizer,
    *,
    recipe: str = "pretrain",
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
    source: str = "data",
) -> list[Document]:
    """Documents of `records`; empty ones are dropped. `ValueError` when none are left."""
    docs = []
    for i, record in enumerate(records):
        where = f"{source} record {i + 1}"
        if recipe == "sft":
            parts = [
                (_field(record, prompt_field, where), False),
                (_field(record, response_field, where), True),
            ]
        else:
            parts = [(_field(record, text_field, where), True)]
        doc = _document(tokenizer, parts)
        if doc is not None:
            docs.append(doc)
    if not docs:
        raise ValueError(f"{source}: no non-empty documents to train on")
    return docs
