"""Data: tokenizers, JSONL, packing, labels and masks against independent constructions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcp.attention import registry as cp_modes
from flashcp.attention.registry import make_assignment
from flashcp.config import IGNORE_INDEX, build_config
from flashcp.cp.layout import Assignment, unshard_assigned
from flashcp.cp.shard import shard_batch
from flashcp.data import (
    ByteTokenizer,
    Document,
    HFTokenizer,
    PackedStream,
    TrainData,
    build_tokenizer,
    collate,
    default_corpus_text,
    parse_jsonl,
    read_records,
    shift_labels,
    tokenize_records,
)

# -- tokenizers -------------------------------------------------------------------------------


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


# -- documents --------------------------------------------------------------------------------


def test_jsonl_errors_name_the_line() -> None:
    with pytest.raises(ValueError, match=r"f.jsonl:2: not valid JSON"):
        list(parse_jsonl('{"text": "a"}\n{oops\n', "f.jsonl"))
    with pytest.raises(ValueError, match=r"f.jsonl:1: expected a JSON object"):
        list(parse_jsonl("[1, 2]\n", "f.jsonl"))
    with pytest.raises(ValueError, match="record 1: missing field 'text'.*set data.text_field"):
        tokenize_records([{"body": "x"}], ByteTokenizer())
    with pytest.raises(ValueError, match="record 2: empty text"):
        tokenize_records([{"text": "a"}, {"text": ""}], ByteTokenizer())
    with pytest.raises(ValueError, match="data: no records"):
        tokenize_records([], ByteTokenizer())


def test_default_corpus_is_shipped_and_clean() -> None:
    records = read_records(None)
    assert len(records) >= 200
    texts = [r["text"] for r in records]
    assert len(set(texts)) == len(texts) and all(len(t) > 80 for t in texts)
    assert default_corpus_text().count("\n") == len(records)


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


# -- packing: independent construction --------------------------------------------------------


def _docs(lengths: list[int], seed: int = 0) -> list[Document]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, 250, size=n).astype(np.int64)
        tokens[0] = 1000 + i  # marks the start of document i
        targets = np.ones(n, dtype=bool)
        targets[0] = False
        out.append(Document(tokens, targets))
    return out


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
    docs = _docs([5, 17, 3, 9, 30, 2, 11])
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
    docs = _docs([4] * 20)

    def firsts(seed: int) -> list[int]:
        s = PackedStream(docs, 8, seed=seed)
        return [int(t) for _ in range(10) for t in s.next().tokens if t >= 1000]

    assert firsts(5) == firsts(5)
    assert firsts(5) != firsts(6)


def test_stream_position_restores_exactly() -> None:
    docs = _docs([7, 13, 5, 21, 3])
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
    docs = _docs([5, 30])
    stream = PackedStream(docs, 8, shuffle=False, packing=False, pad_id=99)
    short = stream.next()
    assert short.tokens.tolist()[5:] == [99, 99, 99] and short.doc_lens == [5, 3]
    assert not short.targets[5:].any()
    batch = collate([short])
    assert batch.labels[0, 4:].tolist() == [IGNORE_INDEX] * 4
    long = stream.next()
    assert long.doc_lens == [8] and long.tokens.tolist() == docs[1].tokens[:8].tolist()


def test_collate_pad_to_keeps_real_tokens_unchanged() -> None:
    docs = _docs([6, 9])
    seqs = [PackedStream(docs, 10, shuffle=False).next()]
    plain, padded = collate(seqs), collate(seqs, pad_to=16, pad_id=0)
    assert padded.input_ids.shape == (1, 16) and padded.doc_lens[0][-1] == 6
    assert (padded.labels[0, 10:] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(padded.labels[:, :10], plain.labels)
    np.testing.assert_array_equal(padded.mask.dense()[0, 0, :10, :10], plain.mask.dense()[0, 0])
    assert padded.mask.dense()[0, 0, :10, 10:].all()  # real rows never see padding


# -- sharding and the per-rank loader ---------------------------------------------------------


@pytest.mark.parametrize("mode", cp_modes.names())
def test_shards_reassemble_with_global_positions(mode: str) -> None:
    stream = PackedStream(_docs([9, 40, 3, 17, 25, 6]), 32, seed=0)
    batch = collate([stream.next(), stream.next()])
    world = 2
    asg: Assignment = make_assignment(mode, world, batch.mask.indices, causal=True)
    parts = [shard_batch(batch, r, asg) for r in range(world)]
    for name in ("input_ids", "labels", "positions"):
        whole = unshard_assigned([getattr(p, name) for p in parts], asg, axis=1)
        np.testing.assert_array_equal(whole, getattr(batch, name))
    for r, part in enumerate(parts):
        assert part.positions[0].tolist() == asg.positions(32, r).tolist()
        assert part.mask is batch.mask
    assert sum(int((p.labels != IGNORE_INDEX).sum()) for p in parts) == batch.num_targets


def test_dp_ranks_split_the_global_batch() -> None:
    def cfg(mbs: int, accum: int = 1):
        return build_config(
            {
                "model": {"preset": "tiny"},
                "data": {"seq_len": 32, "micro_batch_size": mbs},
                "train": {"grad_accum": accum},
            }
        )

    whole = TrainData(cfg(2)).next_step()
    ranks = [TrainData(cfg(1), dp_rank=r, dp_size=2).next_step() for r in range(2)]
    for r in range(2):
        np.testing.assert_array_equal(ranks[r][0].input_ids[0], whole[0].input_ids[r])
    accum = TrainData(cfg(1, accum=2)).next_step()
    assert len(accum) == 2
    np.testing.assert_array_equal(accum[1].input_ids[0], whole[0].input_ids[1])


def test_train_data_pads_when_configured() -> None:
    cfg = build_config(
        {
            "model": {"preset": "tiny"},
            "parallel": {"cp": 2, "pad": True},
            "data": {"seq_len": 30},
        }
    )
    data = TrainData(cfg)
    assert data.seq_len == 32
    (batch,) = data.next_step()
    assert batch.input_ids.shape == (1, 32) and batch.doc_lens[0][-1] == 2
    state = data.state_dict()
    nxt = data.next_step()[0].input_ids
    again = TrainData(cfg)
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.next_step()[0].input_ids, nxt)
