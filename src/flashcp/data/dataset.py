"""Documents: data records → token arrays with a per-token "is a training target" flag.

A pretrain document is `[BOS] text [EOS]`, every token after the first a target. An SFT
document is a conversation (`messages`, rendered by the chat template, the assistant turns the
targets) or `[BOS] prompt response [EOS]` where only the response tokens and the EOS are
targets (the model is not trained to produce the prompt); see `DocumentBuilder`. The flags
travel with the tokens through packing, and `flashcp.data.packing.shift_labels` turns them into
labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashcp.data import formats
from flashcp.data.chat import chat_segments, tokenize_segments
from flashcp.data.records import BadRecordError, check_answers, string_field
from flashcp.data.sources import BUILTIN_PREFERENCES, read_records
from flashcp.data.tokenizer import Tokenizer, require_template


@dataclass(frozen=True, eq=False)
class Document:
    """One tokenized document: `tokens` (int64 [n]) and `targets` (bool [n])."""

    tokens: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def prefix_len(self) -> int:
        """Tokens before the first target (sft: the prompt): a prefix-LM document's
        bidirectional prefix (`attention.mask: prefix_lm`)."""
        first = np.flatnonzero(self.targets)
        return int(first[0]) if len(first) else len(self)


def builtin_sft_records(
    prompt_field: str = "prompt", response_field: str = "response"
) -> list[dict[str, Any]]:
    """The built-in instruction set: the built-in DPO preference pairs' prompts, each with its
    preferred ("chosen") answer as the response (used by the sft recipe when data.path is null)."""
    return [
        {prompt_field: r["prompt"], response_field: r["chosen"]}
        for r in read_records(BUILTIN_PREFERENCES, name="built-in preference set")
    ]


def _document(
    tokenizer: Tokenizer, ids: Sequence[int], flags: Sequence[bool], *, chat: bool
) -> Document:
    """Plain text: `[BOS] ids [EOS]` (BOS if the tokenizer has one). A rendered conversation
    (`chat`): `ids [EOS]`, the template having written any prefix, and EOS left out when the
    last answer already holds it (a template closing turns with the EOS token). EOS is a
    target: the model learns to stop."""
    tokens = list(ids)
    targets = list(flags)
    if not chat and tokenizer.bos_id is not None:
        tokens.insert(0, tokenizer.bos_id)
        targets.insert(0, False)
    start = len(targets)  # where the trailing run of targets (the last answer) begins
    while start > 0 and targets[start - 1]:
        start -= 1
    if not chat or tokenizer.eos_id not in tokens[start:]:
        tokens.append(tokenizer.eos_id)
        targets.append(True)
    return Document(np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=bool))


class DocumentBuilder:
    """A record → its `Document` (or `BadRecordError`), per the kind of example its recipe
    reads (`RecipeSpec.examples`):

    * text (pretrain): `[BOS] text [EOS]`, every token after the first a target
      (`data.text_field`);
    * supervised (sft), a conversation (`data.messages_field`, or a ShareGPT / Alpaca /
      PaddleFormers row: `flashcp.data.formats`): rendered by the tokenizer's chat template
      (`flashcp.data.chat`, no BOS of our own: the template writes any prefix), the assistant
      turns the targets, then EOS (a target) unless the last turn already ends the text with
      it;
    * supervised, `prompt_response`: `[BOS] prompt response [EOS]` with `data.prompt_field` /
      `data.response_field` strings, the response and EOS the targets.

    `format`: `data.format` (`auto`: each row in the first of the recipe's formats whose
    fields it has).

    `max_len`: with `data.packing: false` each document is cut to seq_len, so one whose targets
    all lie beyond it is a bad record ("too long"). `prefix_len` (pretrain under
    `attention.mask: prefix_lm`): the first prefix_len tokens, at most all but the last, are no
    targets — they form the document's bidirectional prefix (`Document.prefix_len`), and a
    token that sees the next one cannot be trained to predict it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        recipe: str = "pretrain",
        text_field: str = "text",
        prompt_field: str = "prompt",
        response_field: str = "response",
        messages_field: str = "messages",
        max_len: int | None = None,
        format: str = "auto",
        prefix_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.prefix_len = prefix_len
        self.recipe = recipe
        self.text_field = text_field
        self.prompt_field = prompt_field
        self.response_field = response_field
        self.messages_field = messages_field
        self.max_len = max_len
        self.fields = formats.Fields(
            text=text_field, prompt=prompt_field, response=response_field, messages=messages_field
        )
        self.supervised = formats.examples_of(recipe) == "supervised"
        self.format = formats.get(format, recipe) if self.supervised else None

    def __call__(self, record: dict[str, Any]) -> Document:
        doc = self._build(record)
        if self.max_len is not None and not doc.targets[1 : self.max_len].any():
            first = int(np.flatnonzero(doc.targets[1:])[0]) + 1
            raise BadRecordError(
                "too long",
                f"its first trained token is at position {first}, but data.packing: false "
                f"cuts every record to data.seq_len {self.max_len} tokens",
            )
        return doc

    def _build(self, record: dict[str, Any]) -> Document:
        tok = self.tokenizer
        if not self.supervised:
            text = string_field(record, self.text_field, key="data.text_field")
            ids = tok.encode(text)
            if not ids:
                raise BadRecordError("empty text", f"field {self.text_field!r} has no tokens")
            doc = _document(tok, ids, [True] * len(ids), chat=False)
            if self.prefix_len:
                doc.targets[: min(self.prefix_len, len(doc) - 1)] = False
            return doc
        fmt = self.format or formats.row_format(record, self.recipe, self.fields)
        if fmt is None:
            raise formats.no_format(record, self.recipe, self.fields)
        fmt.check(record, self.fields)
        if fmt.messages is not None:
            require_template(tok, fmt.name, fmt.layout)
            messages = fmt.messages(record, self.fields)
            check_answers(messages, fmt.field(self.fields))
            ids, flags = tokenize_segments(tok, chat_segments(tok, messages))
            return _document(tok, ids, flags, chat=True)
        prompt = tok.encode(string_field(record, self.prompt_field, key="data.prompt_field"))
        response = tok.encode(
            string_field(record, self.response_field, key="data.response_field", allow_empty=False)
        )
        flags = [False] * len(prompt) + [True] * len(response)
        return _document(tok, prompt + response, flags, chat=False)


def tokenize_records(
    records: Sequence[dict[str, Any]],
    tokenizer: Tokenizer,
    *,
    recipe: str = "pretrain",
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    source: str = "data",
) -> list[Document]:
    """Documents of in-memory `records`, all of them: a bad record raises `ValueError` naming
    it (the training data path, `flashcp.data.index`, counts and skips them instead)."""
    build = DocumentBuilder(
        tokenizer,
        recipe=recipe,
        text_field=text_field,
        prompt_field=prompt_field,
        response_field=response_field,
        messages_field=messages_field,
    )
    docs = []
    for i, record in enumerate(records):
        try:
            docs.append(build(record))
        except BadRecordError as exc:
            raise ValueError(f"{source} record {i + 1}: {exc}") from None
    if not docs:
        raise ValueError(f"{source}: no records")
    return docs
