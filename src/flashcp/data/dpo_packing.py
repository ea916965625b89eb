"""DPO examples (`flashcp.data.dpo_records.DPOExample`) -> packed share-question batches.

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
from typing import Any

import numpy as np

from flashcp.data.dpo_records import DPOExample, fit_examples
from flashcp.masks import Mask, causal_document_mask, share_question_mask

IGNORE_INDEX = -100


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

