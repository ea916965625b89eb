"""DPO preference data: records -> token examples -> packed share-question batches.

Records hold ``prompt``, ``chosen`` and ``rejected`` (field names: `data.prompt_field`,
`data.chosen_field`, `data.rejected_field`) in one of two forms (`DPORecords`):

* strings: ``prompt = [BOS] + encode(prompt)``, ``answer = encode(answer) + [EOS]``;
* conversations (TRL's conversational preference format): the prompt a list of messages, each
  answer the assistant turn (a one-message list, a message, or its content as a string). The
  prompt is the tokenizer's chat template rendering of the prompt messages with the generation
  prompt (for GLM ``[gMASK]<sop><|user|>\n...<|assistant|>``), each answer the text the
  template adds for the assistant turn after it (`flashcp.data.chat.answer_text`), tokenized
  on its own, + [EOS] unless the template's answer already holds it.

Packed layout (`pack_dpo`). Both answers must be scored given the same prompt, and the last
prompt token predicts the first token of *each* answer, which one label slot cannot hold. So
(as PaddleFormers' DPO data does) the last prompt token is repeated at the head of each answer
segment, and an answer's final token (never an input for a target) is dropped::

    prompt p0..p3, chosen c0 c1 EOS, rejected r0 EOS

    tokens     p0 p1 p2 | p3 c0 c1  | p3 r0
    positions   0  1  2 |  3  4  5  |  3  4      (both answers continue from the prompt)
    labels      -  -  - | c0 c1 EOS | r0 EOS     (labels shifted within each answer only)
    segments   (3,       3,          2)          -> masks.share_question_mask

Each answer segment sees the shortened prompt and itself (the rejected answer never sees the
chosen one), so every logit equals the one the unpacked sequence ``prompt + answer`` gives at the
same position: packed and unpacked answer log-prob sums agree. Several examples share a row
(first-fit, in order); examples never see each other, and the row's tail is padding (its own
causal document, label -100). A packed example takes ``len(prompt) - 1 + len(chosen) +
len(rejected)`` tokens, the prompt once instead of twice.

Unpacked baseline (`unpack_dpo`): ``prompt + answer[:-1]`` as one causal sequence per answer,
padded to the smallest length bucket that holds it, labels on the answer tokens only.

`DPOBatch.spans` `[N, 2, 3]` holds, per example, the (row, start, end) label columns of its
chosen (`[:, 0]`) and rejected (`[:, 1]`) answer; `flashcp.recipes.dpo_loss.sequence_logps`
sums per-token log-probs over them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from flashcp.data import formats
from flashcp.data.chat import answer_text, render
from flashcp.data.records import (
    ROLE_ASSISTANT,
    BadRecordError,
    check_answers,
    has_field,
    message_list,
    string_field,
)
from flashcp.data.tokenizer import require_template
from flashcp.masks import Mask, causal_document_mask, share_question_mask

IGNORE_INDEX = -100
TRUNCATION_POLICIES = ("error", "truncate")


class DPOTokenizer(Protocol):
    """What DPO tokenization needs (the trainer's tokenizers qualify)."""

    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> str: ...


@dataclass(frozen=True)
class DPOExample:
    """One tokenized preference pair. The prompt is never empty; answers end with EOS."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]

    @property
    def packed_len(self) -> int:
        """Tokens this example takes in a packed row (the prompt's last token per answer)."""
        return len(self.prompt) - 1 + len(self.chosen) + len(self.rejected)

    def unpacked_len(self, answer: int) -> int:
        """Tokens of the unpacked ``prompt + answer[:-1]`` (answer 0 chosen, 1 rejected)."""
        return len(self.prompt) + len(self.answers[answer]) - 1

    @property
    def answers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.chosen, self.rejected)


@dataclass(eq=False)
class DPOBatch:
    """`[B, L]` int64 arrays for the model plus the answer spans of the N examples it holds.

    `spans[n, a] = (row, start, end)`: labels of answer `a` (0 chosen, 1 rejected) of example
    `n` sit at columns [start, end) of `row`, and `end - start` is the answer's token count;
    row -1 (with start = end = 0) means the answer is not in this batch (unpacked batches whose
    two answers fell in different buckets). `example_ids[n]` is the index of example n in the
    list given to `pack_dpo`/`unpack_dpo`. `real` is True where a token belongs to an example
    (False on padding).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    labels: np.ndarray
    mask: Mask
    spans: np.ndarray
    example_ids: np.ndarray
    real: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        b, seq = self.input_ids.shape
        return int(b), int(seq)

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_examples(self) -> int:
        return int(self.spans.shape[0])

    @property
    def num_real_tokens(self) -> int:
        """Tokens that are not padding (prompt and answer segments)."""
        return int(self.real.sum())

    def response_indexs(self) -> np.ndarray:
        """The spans in PaddleFormers' DPO format `[N, 4]` = (row, chosen start, rejected start,
        rejected end); only valid when each rejected answer directly follows its chosen one (as
        in packed batches)."""
        c, r = self.spans[:, 0], self.spans[:, 1]
        if not (np.array_equal(c[:, 0], r[:, 0]) and np.array_equal(c[:, 2], r[:, 1])):
            raise ValueError("response_indexs needs each rejected span right after its chosen one")
        return np.stack([c[:, 0], c[:, 1], r[:, 1], r[:, 2]], axis=1).astype(np.int64)


# ------------------------------------------------------------------------------ records


class DPORecords:
    """A record → its `DPOExample`, fitted to `budget` tokens (packed layout), or
    `BadRecordError`: a missing or mistyped field, an empty answer, a prompt of fewer than 2
    tokens, strings mixed with messages, or an example too long even after `truncation`
    (the prompt leaving the answers no room). `truncation="error"` refuses any example longer
    than `budget` with a `ValueError` (it stops the run, naming the row).

    `format`: `data.format` (`auto`: each row in the first dpo format whose fields it has:
    PaddleFormers, UltraFeedback, prompt/chosen/rejected, TRL's implicit prompt;
    `flashcp.data.formats`). Every conversational format is tokenized like TRL's
    conversational rows (the module docstring)."""

    def __init__(
        self,
        tokenizer: DPOTokenizer,
        *,
        budget: int,
        truncation: str = "truncate",
        max_prompt_len: int | None = None,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        format: str = "auto",
    ) -> None:
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got "
                             f"{truncation!r}")  # fmt: skip
        self.tokenizer = tokenizer
        self.budget = int(budget)
        self.truncation = truncation
        self.max_prompt_len = max_prompt_len
        self.fields = (prompt_field, chosen_field, rejected_field)
        self.names = formats.Fields(prompt=prompt_field, chosen=chosen_field,
                                    rejected=rejected_field)  # fmt: skip
        self.format = formats.get(format, "dpo")

    def __call__(self, record: dict[str, Any]) -> DPOExample:
        example = self.tokenize(record)
        need = example.packed_len
        if need > self.budget and self.truncation == "error":
            raise ValueError(
                f"the example needs {need} tokens packed (prompt {len(example.prompt)}, chosen "
                f"{len(example.chosen)}, rejected {len(example.rejected)}) but data.seq_len is "
                f"{self.budget}: raise data.seq_len or set dpo.truncation: truncate"
            )
        try:
            return fit_example(example, self.budget, max_prompt_len=self.max_prompt_len)
        except ValueError as exc:
            raise BadRecordError("too long", str(exc)) from None

    def tokenize(self, record: dict[str, Any]) -> DPOExample:
        """The example before truncation."""
        fmt = self.format or formats.row_format(record, "dpo", self.names)
        if fmt is None:
            raise formats.no_format(record, "dpo", self.names)
        fmt.check(record, self.names)
        if fmt.preference is not None:
            require_template(self.tokenizer, fmt.name, fmt.layout)
            messages, chosen, rejected = fmt.preference(record, self.names)
            return self._conversation(
                message_list(messages, self.fields[0]),
                ((chosen, self.fields[1]), (rejected, self.fields[2])),
            )
        tok = self.tokenizer
        prompt_field, chosen_field, rejected_field = self.fields
        for name in self.fields:
            if not has_field(record, name):
                keys = ", ".join(sorted(record)) or "none"
                raise BadRecordError(
                    f"missing field {name!r}",
                    f"the record's keys: {keys}; DPO records need {prompt_field!r}, "
                    f"{chosen_field!r} and {rejected_field!r} (data.prompt_field, "
                    "data.chosen_field, data.rejected_field name them)",
                )
        if not isinstance(record[prompt_field], str):
            messages = message_list(record[prompt_field], prompt_field)
            return self._conversation(
                messages, ((record[chosen_field], chosen_field),
                           (record[rejected_field], rejected_field))  # fmt: skip
            )
        eos = int(tok.eos_id)
        prompt_text = record[prompt_field]
        bos = getattr(tok, "bos_id", None)
        prompt = ([int(bos)] if bos is not None else []) + list(tok.encode(prompt_text))
        answers = []
        for name in (chosen_field, rejected_field):
            if isinstance(record[name], list | dict):
                raise BadRecordError(
                    "prompt is a string but an answer is a message",
                    f"{name!r} is a {type(record[name]).__name__}: give messages for the "
                    "prompt too, or strings for both answers",
                )
            text = string_field(record, name, allow_empty=False)
            answers.append([*tok.encode(text), eos])
        return self._example(prompt, answers)

    def _conversation(
        self, messages: list[dict[str, Any]], answers: Sequence[tuple[Any, str]]
    ) -> DPOExample:
        """A conversational example: the prompt `messages` rendered with the generation
        prompt, each answer (a value and its field name) the text its assistant turn adds."""
        tok = self.tokenizer
        eos = int(tok.eos_id)
        prompt_text = render(tok, messages, add_generation_prompt=True)
        prompt = list(tok.encode(prompt_text))
        ids_of = []
        for value, name in answers:
            turn = self._turn(value, name)
            ids = list(tok.encode(answer_text(tok, messages, prompt_text, turn)))
            ids_of.append(ids if eos in ids else [*ids, eos])
        return self._example(prompt, ids_of)

    @staticmethod
    def _example(prompt: list[int], answers: list[list[int]]) -> DPOExample:
        if len(prompt) < 2:
            raise BadRecordError(
                "prompt too short",
                f"{len(prompt)} token(s); the packed layout needs >= 2 (BOS and one text token)",
            )
        return DPOExample(tuple(prompt), tuple(answers[0]), tuple(answers[1]))

    @staticmethod
    def _turn(value: Any, name: str) -> dict[str, Any]:
        """The assistant message an answer field holds (a one-message list, a message dict, or
        the content string)."""
        if isinstance(value, str):
            value = [{"role": ROLE_ASSISTANT, "content": value}]
        elif isinstance(value, dict):
            value = [value]
        messages = message_list(value, name)
        if len(messages) != 1 or messages[0]["role"] != ROLE_ASSISTANT:
            roles = ", ".join(m["role"] for m in messages)
            raise BadRecordError(
                "an answer is not one assistant turn",
                f"{name!r} holds {len(messages)} message(s) ({roles})",
            )
        check_answers(messages, name)
        return messages[0]


# ---------------------------------------------------------------------------- truncation

LAYOUTS = ("packed", "unpacked")


def example_need(example: DPOExample, layout: str) -> int:
    """Tokens `example` needs: one packed segment, or the longer of its unpacked sequences."""
    if layout == "packed":
        return example.packed_len
    if layout == "unpacked":
        return max(example.unpacked_len(0), example.unpacked_len(1))
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def fit_example(
    example: DPOExample,
    budget: int,
    *,
    layout: str = "packed",
    max_prompt_len: int | None = None,
) -> DPOExample:
    """`example` truncated so that `example_need(result, layout) <= budget`.

    The prompt first keeps its last `max_prompt_len` tokens (if given); then the answers are cut
    from the end to a common cap (the longer one shrinks first), each keeping >= 1 token. If the
    prompt leaves no room for that, `ValueError`. An example that fits is returned unchanged.
    """
    if example_need(example, layout) <= budget:
        return example
    prompt = example.prompt
    if max_prompt_len is not None and len(prompt) > max_prompt_len:
        if max_prompt_len < 2:
            raise ValueError(f"max_prompt_len must be >= 2, got {max_prompt_len}")
        prompt = prompt[-max_prompt_len:]
    room = budget - (len(prompt) - 1)  # what the answers may use
    need = 2 if layout == "packed" else 1
    if room < need:
        raise ValueError(
            f"a prompt of {len(prompt)} tokens leaves {max(room, 0)} of the {budget}-token "
            f"budget for the answers ({layout} layout needs >= {need}): set max_prompt_len or "
            "give a longer length"
        )
    c, r = len(example.chosen), len(example.rejected)
    cap = room
    if layout == "packed":
        cap = max(c, r)
        while min(c, cap) + min(r, cap) > room:
            cap -= 1
    return DPOExample(prompt, example.chosen[:cap], example.rejected[:cap])


def fit_examples(
    examples: Sequence[DPOExample],
    budget: int,
    *,
    layout: str = "packed",
    truncation: str = "error",
    max_prompt_len: int | None = None,
) -> list[DPOExample]:
    """Check (`truncation="error"`) or truncate (`"truncate"`) every example to `budget`.

    Errors name the example, its lengths and the budget. To compare layouts on the same tokens,
    truncate once (e.g. for the packed `seq_len`) and give the result to both.
    """
    if truncation not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
    out = []
    for i, ex in enumerate(examples):
        need = example_need(ex, layout)
        if need > budget and truncation == "error":
            raise ValueError(
                f"DPO example {i} needs {need} tokens in the {layout} layout (prompt "
                f"{len(ex.prompt)}, chosen {len(ex.chosen)}, rejected {len(ex.rejected)}) but "
                f"only {budget} fit: use a longer length or truncation='truncate'"
            )
        out.append(fit_example(ex, budget, layout=layout, max_prompt_len=max_prompt_len))
    return out


# ------------------------------------------------------------------------------- packing


def _check_seq_len(seq_len: int) -> int:
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 3:
        raise ValueError(f"seq_len must be an integer >= 3, got {seq_len!r}")
    return int(seq_len)


def assign_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit: example indices per row, in order, each row's lengths summing to <= seq_len.

    Each example goes to the lowest-numbered row with room for it, else a new row. The rows'
    free space sits in a max segment tree whose unused leaves hold a whole empty row, so the
    leftmost leaf with room is exactly first-fit's choice: O(log n) per example instead of a
    scan over every open row (quadratic over a dataset's epoch).
    """
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    tree = [int(seq_len)] * (2 * size)  # tree[size + r]: free tokens of row r
    rows: list[list[int]] = []
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"example {i} needs {n} tokens > seq_len {seq_len}")
        node = 1
        while node < size:  # descend to the leftmost leaf with room (the root always has)
            node = 2 * node if tree[2 * node] >= n else 2 * node + 1
        r = node - size
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        tree[node] -= n
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


def pack_dpo(
    examples: Sequence[DPOExample],
    seq_len: int,
    *,
    pad_id: int,
    max_rows: int | None = None,
    truncation: str = "error",
    max_prompt_len: int | None = None,
) -> DPOBatch:
    """All `examples` packed into one `DPOBatch` of `[rows, seq_len]` (share-question mask).

    `truncation="error"` (default) raises for an example longer than `seq_len`;
    `"truncate"` shortens it with `fit_example`. `max_rows` bounds the rows: needing more is an
    overflow `ValueError` (use `pack_dpo_batches` to split a dataset into batches).
    """
    seq_len = _check_seq_len(seq_len)
    if not examples:
        raise ValueError("pack_dpo needs at least one example")
    exs = fit_examples(examples, seq_len, truncation=truncation, max_prompt_len=max_prompt_len)
    rows = assign_rows([e.packed_len for e in exs], seq_len)
    if max_rows is not None and len(rows) > max_rows:
        need = sum(e.packed_len for e in exs)
        raise ValueError(
            f"{len(exs)} DPO examples ({need} tokens) need {len(rows)} rows of {seq_len} tokens "
            f"but max_rows is {max_rows}: use fewer examples per batch or a longer seq_len"
        )
    return _collate_packed(exs, rows, seq_len, pad_id, list(range(len(exs))))


def collate_packed(
    examples: Sequence[DPOExample], rows: Sequence[Sequence[int]], seq_len: int, *, pad_id: int
) -> DPOBatch:
    """One `DPOBatch` of `len(rows)` rows, row r holding `examples[i]` for i in `rows[r]` (in
    order; each row's examples must fit `seq_len`, as `assign_rows` guarantees).
    `example_ids` are the indices into `examples`."""
    seq_len = _check_seq_len(seq_len)
    for r, members in enumerate(rows):
        need = sum(examples[i].packed_len for i in members)
        if need > seq_len:
            raise ValueError(f"row {r} needs {need} tokens > seq_len {seq_len}")
    return _collate_packed(examples, rows, seq_len, pad_id, range(len(examples)))


def _collate_packed(
    exs: Sequence[DPOExample],
    rows: Sequence[Sequence[int]],
    seq_len: int,
    pad_id: int,
    ids: Sequence[int],
) -> DPOBatch:
    b = len(rows)
    tokens = np.full((b, seq_len), int(pad_id), dtype=np.int64)
    positions = np.zeros((b, seq_len), dtype=np.int64)
    labels = np.full((b, seq_len), IGNORE_INDEX, dtype=np.int64)
    real = np.zeros((b, seq_len), dtype=bool)
    spans: list[list[tuple[int, int, int]]] = []
    order: list[int] = []
    masks = []
    for r, members in enumerate(rows):
        col = 0
        segments = []
        for i in members:
            ex = exs[i]
            p = len(ex.prompt) - 1  # the shared part: all but the prompt's last token
            tokens[r, col : col + p] = ex.prompt[:-1]
            positions[r, col : col + p] = np.arange(p)
            col += p
            ex_spans = []
            for answer in ex.answers:
                n = len(answer)
                tokens[r, col] = ex.prompt[-1]
                tokens[r, col + 1 : col + n] = answer[:-1]
                positions[r, col : col + n] = np.arange(p, p + n)
                labels[r, col : col + n] = answer
                ex_spans.append((r, col, col + n))
                col += n
            segments.append((p, len(ex.chosen), len(ex.rejected)))
            spans.append(ex_spans)
            order.append(int(ids[i]))
        real[r, :col] = True
        positions[r, col:] = np.arange(seq_len - col)  # padding: its own causal document
        masks.append(share_question_mask(segments, seq_len=seq_len).indices)
    return DPOBatch(
        input_ids=tokens,
        positions=positions,
        labels=labels,
        mask=Mask(np.concatenate(masks, axis=0), causal=True),
        spans=np.asarray(spans, dtype=np.int64).reshape(-1, 2, 3),
        example_ids=np.asarray(order, dtype=np.int64),
        real=real,
    )


def pack_dpo_batches(
    examples: Sequence[DPOExample],
    seq_len: int,
    rows_per_batch: int,
    *,
    pad_id: int,
    truncation: str = "error",
    max_prompt_len: int | None = None,
) -> Iterator[DPOBatch]:
    """Pack `examples` (first-fit, in order) and yield batches of `rows_per_batch` rows.

    The last batch is filled with all-padding rows (no examples, no labels) to keep the shape.
    """
    seq_len = _check_seq_len(seq_len)
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    exs = fit_examples(examples, seq_len, truncation=truncation, max_prompt_len=max_prompt_len)
    rows = assign_rows([e.packed_len for e in exs], seq_len)
    for start in range(0, len(rows), rows_per_batch):
        chunk = rows[start : start + rows_per_batch]
        chunk = chunk + [[] for _ in range(rows_per_batch - len(chunk))]
        yield _collate_packed(exs, chunk, seq_len, pad_id, list(range(len(exs))))


# ------------------------------------------------------------------------ unpacked baseline


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (buckets need not be sorted)."""
    fits = [int(b) for b in buckets if int(b) >= n]
    if not fits:
        raise ValueError(f"a {n}-token sequence fits no length bucket (largest {max(buckets)})")
    return min(fits)


def unpack_dpo(
    examples: Sequence[DPOExample],
    buckets: Sequence[int],
    *,
    pad_id: int,
    rows_per_batch: int | None = None,
    paired: bool = False,
    truncation: str = "error",
    max_prompt_len: int | None = None,
) -> list[DPOBatch]:
    """The prompt-repeated baseline: ``prompt + answer[:-1]`` per answer, causal, padded.

    Each sequence goes to the smallest bucket that holds it (`paired=True`: both answers of an
    example go to the bucket of the longer one, so a batch always holds whole pairs); sequences
    of one bucket are batched together, in example order (at most `rows_per_batch` rows,
    default all). A pair split over two batches leaves row -1 spans (see `DPOBatch`). Labels
    sit on the answer tokens (`labels[i] = answer[i - len(prompt) + 1]`), so the span sums
    equal the packed ones.
    """
    if not buckets or any(int(b) < 2 for b in buckets):
        raise ValueError(f"buckets must be a non-empty list of lengths >= 2, got {list(buckets)}")
    if not examples:
        raise ValueError("unpack_dpo needs at least one example")
    if rows_per_batch is not None and (rows_per_batch < 1 or (paired and rows_per_batch % 2)):
        raise ValueError(
            f"rows_per_batch must be >= 1 (and even with paired=True), got {rows_per_batch}"
        )
    top = max(int(b) for b in buckets)
    exs = fit_examples(
        examples, top, layout="unpacked", truncation=truncation, max_prompt_len=max_prompt_len
    )
    by_bucket: dict[int, list[tuple[int, int]]] = {}
    for i, ex in enumerate(exs):
        lens = [ex.unpacked_len(a) for a in (0, 1)]
        if paired:
            lens = [max(lens)] * 2
        for a in (0, 1):
            by_bucket.setdefault(bucket_for(lens[a], buckets), []).append((i, a))
    out = []
    for length in sorted(by_bucket):
        seqs = by_bucket[length]
        step = rows_per_batch or len(seqs)
        for start in range(0, len(seqs), step):
            out.append(_collate_unpacked(exs, seqs[start : start + step], length, pad_id))
    return out


def _collate_unpacked(
    exs: Sequence[DPOExample], seqs: Sequence[tuple[int, int]], length: int, pad_id: int
) -> DPOBatch:
    b = len(seqs)
    tokens = np.full((b, length), int(pad_id), dtype=np.int64)
    positions = np.zeros((b, length), dtype=np.int64)
    labels = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    real = np.zeros((b, length), dtype=bool)
    doc_lens = []
    spans: dict[int, list[Any]] = {}
    for r, (i, a) in enumerate(seqs):
        ex = exs[i]
        answer = ex.answers[a]
        seq = list(ex.prompt) + list(answer[:-1])
        n, p = len(seq), len(ex.prompt)
        tokens[r, :n] = seq
        positions[r, :n] = np.arange(n)
        positions[r, n:] = np.arange(length - n)
        labels[r, p - 1 : n] = answer
        real[r, :n] = True
        doc_lens.append([n, length - n] if n < length else [n])
        spans.setdefault(i, [None, None])[a] = (r, p - 1, n)
    # An example whose answers landed in different batches has a missing answer: row -1.
    ids = sorted(spans)
    span_arr = np.asarray(
        [[s if s is not None else (-1, 0, 0) for s in spans[i]] for i in ids], dtype=np.int64
    )
    masks = [causal_document_mask(lens).indices for lens in doc_lens]
    return DPOBatch(
        input_ids=tokens,
        positions=positions,
        labels=labels,
        mask=Mask(np.concatenate(masks, axis=0), causal=True),
        spans=span_arr.reshape(-1, 2, 3),
        example_ids=np.asarray(ids, dtype=np.int64),
        real=real,
    )
