"""Packing (`flashcp.data.packing`): the packed stream, its labels and collation against
independent constructions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcp.config import IGNORE_INDEX
from flashcp.data import Document, PackedStream, collate, shift_labels
from helpers.batches import marked_documents


def _reference_stream(docs: list[Document], seq_len: int, n_seqs: int, order_of) -> list[tuple]:
    """Concatenate docs in epoch order, cut every seq_len tokens; naive loops for the rest."""
    toks, tgts, doc_id, seg_start = [], [], [], []
    epoch = 0
    while len(toks) < seq_len * n_seqs:
        for d in order_of(epoch):
            for j in range(len(docs[d])):
                toks.append(int(docs[d].tokens[j]))
                tgts.append(bool(docs[d].targets[j]))
                doc_id.append((epoch, d))
                seg_start.append(j == 0)
        epoch += 1
    out = []
    for s in range(n_seqs):
        lo, hi = s * seq_len, (s + 1) * seq_len
        t, g, ids = toks[lo:hi], tgts[lo:hi], doc_id[lo:hi]
        labels = [
            t[i + 1] if i + 1 < seq_len and ids[i + 1] == ids[i] and g[i + 1] else IGNORE_INDEX
            for i in range(seq_len)
        ]
        dense = np.array(
            [[not (j <= i and ids[j] == ids[i]) for j in range(seq_len)] for i in range(seq_len)]
        )
        out.append((t, labels, dense))
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_packing_matches_independent_construction(shuffle: bool) -> None:
    docs = marked_documents([5, 17, 3, 9, 30, 2, 11])
    seq_len, n = 16, 12
    stream = PackedStream(docs, seq_len, seed=3, shuffle=shuffle)

    def order_of(epoch: int) -> list[int]:
        if not shuffle:
            return list(range(len(docs)))
        return np.random.default_rng([3, epoch, 0x5EED]).permutation(len(docs)).tolist()

    expected = _reference_stream(docs, seq_len, n, order_of)
    for tokens, labels, dense in expected:
        batch = collate([stream.next()])
        assert batch.input_ids[0].tolist() == tokens
        assert batch.labels[0].tolist() == labels
        np.testing.assert_array_equal(batch.mask.dense()[0, 0], dense)
        assert batch.positions[0].tolist() == list(range(seq_len))
    assert stream.state.sequences == n and stream.state.epoch >= 1


_STRIDE = 64
"""Token `d * _STRIDE + j` is position j of document d: a token names its document and place."""
_PAD = 8 * _STRIDE
"""The padding token (`packing: false`): no document's token."""


def _flagged_docs(flags: list[list[bool]]) -> list[Document]:
    """Document d has `len(flags[d])` tokens, token j a target iff `flags[d][j]` — the first
    token included, as with a tokenizer without BOS (the first text token is a target)."""
    return [
        Document(d * _STRIDE + np.arange(len(f), dtype=np.int64), np.array(f, dtype=bool))
        for d, f in enumerate(flags)
    ]


def _labels_from_tokens(tokens: np.ndarray, flags: list[list[bool]]) -> list[int]:
    """Next-token labels from the tokens alone (no `doc_lens`): token i predicts token i+1 only
    if that is the NEXT token of the same document and a target."""
    labels = [IGNORE_INDEX] * len(tokens)
    for i in range(len(tokens) - 1):
        here, after = int(tokens[i]), int(tokens[i + 1])
        if _PAD in (here, after):
            continue
        (d, j), (d2, j2) = divmod(here, _STRIDE), divmod(after, _STRIDE)
        if d2 == d and j2 == j + 1 and flags[d][j2]:
            labels[i] = after
    return labels


@settings(max_examples=60, deadline=None)
@given(
    flags=st.lists(st.lists(st.booleans(), min_size=1, max_size=40), min_size=1, max_size=8),
    seq_len=st.integers(2, 48),
    packing=st.booleans(),
)
@example(flags=[[True, True, False], [True, True]], seq_len=5, packing=True)
def test_labels_never_cross_documents(flags: list[list[bool]], seq_len: int, packing: bool) -> None:
    """Target flags drawn at random, a document's first token included: a document's last
    token never predicts the next document's first token, even when that one is a target."""
    stream = PackedStream(_flagged_docs(flags), seq_len, seed=1, packing=packing, pad_id=_PAD)
    for _ in range(4):
        seq = stream.next()
        assert sum(seq.doc_lens) == seq_len and min(seq.doc_lens) >= 1
        labels = shift_labels(seq.tokens, seq.targets, seq.doc_lens)
        ends = np.cumsum(seq.doc_lens) - 1
        assert (labels[ends] == IGNORE_INDEX).all()
        ok = labels != IGNORE_INDEX
        np.testing.assert_array_equal(labels[ok], seq.tokens[1:][ok[:-1]])
        want = _labels_from_tokens(seq.tokens, flags)
        assert labels.tolist() == want, "a label crosses a document boundary (or is missing)"
        assert collate([seq]).labels[0].tolist() == want


def test_stream_order_depends_only_on_seed() -> None:
    docs = marked_documents([4] * 20)

    def firsts(seed: int) -> list[int]:
        s = PackedStream(docs, 8, seed=seed)
        return [int(t) for _ in range(10) for t in s.next().tokens if t >= 1000]

    assert firsts(5) == firsts(5)
    assert firsts(5) != firsts(6)


def test_stream_position_restores_exactly() -> None:
    docs = marked_documents([7, 13, 5, 21, 3])
    a = PackedStream(docs, 10, seed=2)
    for _ in range(7):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))
    want = [a.next().tokens.tolist() for _ in range(9)]
    b = PackedStream(docs, 10, seed=2)
    b.load_state_dict(state)
    assert [b.next().tokens.tolist() for _ in range(9)] == want
    with pytest.raises(ValueError, match="does not fit this dataset"):
        PackedStream(docs[:2], 10).load_state_dict(state | {"doc": 4})


def test_no_packing_pads_each_document() -> None:
    docs = marked_documents([5, 30])
    stream = PackedStream(docs, 8, shuffle=False, packing=False, pad_id=99)
    short = stream.next()
    assert short.tokens.tolist()[5:] == [99, 99, 99] and short.doc_lens == [5, 3]
    assert not short.targets[5:].any()
    batch = collate([short])
    assert batch.labels[0, 4:].tolist() == [IGNORE_INDEX] * 4
    long = stream.next()
    assert long.doc_lens == [8] and long.tokens.tolist() == docs[1].tokens[:8].tolist()


def test_collate_pad_to_keeps_real_tokens_unchanged() -> None:
    docs = marked_documents([6, 9])
    seqs = [PackedStream(docs, 10, shuffle=False).next()]
    plain, padded = collate(seqs), collate(seqs, pad_to=16, pad_id=0)
    assert padded.input_ids.shape == (1, 16) and padded.doc_lens[0][-1] == 6
    assert (padded.labels[0, 10:] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(padded.labels[:, :10], plain.labels)
    np.testing.assert_array_equal(padded.mask.dense()[0, 0, :10, :10], plain.mask.dense()[0, 0])
    assert padded.mask.dense()[0, 0, :10, 10:].all()  # real rows never see padding


def _one_pass_rows(stream: PackedStream) -> list[list[tuple[int, int, int]]]:
    """The planned rows of one pass (until the stream's epoch turns)."""
    rows = []
    while stream.state.epoch == 0:
        rows.append([tuple(p) for p in stream.plan_next()])
    return rows


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_pass_holds_every_document_once_and_whole(shuffle: bool) -> None:
    """An eval pass (`one_pass`): every document's tokens exactly once, a document never cut
    unless longer than seq_len (then cut where rows end), the last row padded rather than
    continued into the next epoch; without `one_pass` the last row wraps into it (control)."""
    lengths = [5, 17, 3, 9, 30, 2, 11]
    docs = marked_documents(lengths)
    seq_len = 16
    stream = PackedStream(docs, seq_len, seed=3, shuffle=shuffle, one_pass=True, pad_id=99)
    rows = _one_pass_rows(stream)
    covered = {i: 0 for i in range(len(docs))}
    for row in rows:
        assert sum(n for _, _, n in row) <= seq_len
        for i, start, n in row:
            assert start == covered[i]  # each document's tokens in order, none twice
            covered[i] += n
            whole = start == 0 and n == lengths[i]
            assert whole or lengths[i] > seq_len  # only a too-long document is cut
    assert covered == dict(enumerate(lengths))
    assert rows[-1] and stream.state.doc == 0  # the pass ended with the set's last document
    # the built rows: real tokens, then padding (no targets) up to seq_len
    stream = PackedStream(docs, seq_len, seed=3, shuffle=shuffle, one_pass=True, pad_id=99)
    targets = 0
    for row in rows:
        seq = stream.next()
        real = sum(n for _, _, n in row)
        assert seq.tokens.shape == (seq_len,) and sum(seq.doc_lens) == seq_len
        assert seq.doc_lens[: len(row)] == [n for _, _, n in row]
        assert (seq.tokens[real:] == 99).all() and not seq.targets[real:].any()
        targets += int(seq.targets.sum())
    assert targets == sum(int(d.targets.sum()) for d in docs)
    # control: the training stream fills its last row from the next epoch
    wrap = PackedStream(docs, seq_len, seed=3, shuffle=shuffle)
    wrapped = _one_pass_rows(wrap)
    assert sum(n for row in wrapped for _, _, n in row) > sum(lengths)


def test_one_pass_of_one_short_document_is_one_padded_row() -> None:
    """The defect: one 22-token document in 128-token rows was packed six times over."""
    docs = marked_documents([22])
    stream = PackedStream(docs, 128, shuffle=False, one_pass=True)
    seq = stream.next()
    assert seq.doc_lens == [22, 106] and stream.state.epoch == 1
    assert int(seq.targets.sum()) == 21
    assert int(PackedStream(docs, 128, shuffle=False).next().targets.sum()) > 21  # control


def test_prefix_lm_prefix_stays_with_the_piece_that_holds_it() -> None:
    """`attention.mask: prefix_lm`: a piece's prefix is the part of its document's prefix
    (the leading non-targets) it holds. A document cut at a row's end keeps its prefix in
    the first piece; the piece continuing it in the next row has none — or, when the cut
    falls inside the prefix, the rest of it."""

    def doc(n: int, prefix: int) -> Document:
        return Document(np.arange(n, dtype=np.int64), np.arange(n) >= prefix)

    docs = [doc(10, 4), doc(5, 2), doc(9, 7)]
    stream = PackedStream(docs, 6, shuffle=False, prefixes=[d.prefix_len for d in docs])
    rows = [stream.next() for _ in range(4)]
    assert [r.doc_lens for r in rows] == [[6], [4, 2], [3, 3], [6]]
    # doc 0 cut after 6 of 10 tokens: its 4-token prefix in row 0 only; doc 2 cut after 3 of
    # its 7 prefix tokens: 3 in row 2, the other 4 at the head of row 3
    assert [r.prefix_lens for r in rows] == [[4], [0, 2], [0, 3], [4]]
