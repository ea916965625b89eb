"""A reference for DPO tests: preference records of strings tokenized the plain way, written
independently of `flashcp.data.dpo_records.DPORecords` so that tests can compare the two."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flashcp.data.dpo_records import DPOExample
from flashcp.data.sources import BUILTIN_PREFERENCES, read_records


def builtin_preferences() -> list[dict[str, Any]]:
    """The shipped preference set's records (prompt / chosen / rejected strings)."""
    return read_records(BUILTIN_PREFERENCES)


def plain_dpo_examples(
    records: Iterable[dict[str, Any]], tokenizer: Any, *, add_bos: bool = True
) -> list[DPOExample]:
    """`prompt = [BOS] + encode(prompt)`, `answer = encode(answer) + [EOS]` for records whose
    prompt, chosen and rejected are strings. A prompt under 2 tokens (the packed layout
    repeats its last token) raises `ValueError` naming the record."""
    bos = getattr(tokenizer, "bos_id", None) if add_bos else None
    eos = int(tokenizer.eos_id)
    out: list[DPOExample] = []
    for i, rec in enumerate(records):
        prompt = ([int(bos)] if bos is not None else []) + [
            int(t) for t in tokenizer.encode(rec["prompt"])
        ]
        if len(prompt) < 2:
            raise ValueError(f"DPO record {i}: the prompt {rec['prompt']!r} has {len(prompt)} "
                             "token(s); it needs at least 2 for the packed layout")  # fmt: skip
        chosen = [int(t) for t in tokenizer.encode(rec["chosen"])] + [eos]
        rejected = [int(t) for t in tokenizer.encode(rec["rejected"])] + [eos]
        out.append(DPOExample(tuple(prompt), tuple(chosen), tuple(rejected)))
    return out
