"""Fixed-length training sequences from documents, with masks, labels and a resumable position.

Packing (`data.packing: true`) lays documents back to back; a document that does not fit is
continued at the start of the next sequence. Each sequence records its segment lengths
(`doc_lens`) and, per segment, the part of its document's prefix it holds (`prefix_lens`),
which give its FlashMask: by default causal documents (`masks.causal_document_mask`), a token
attending only to earlier tokens of its own segment; `attention.mask` picks another mask per
segment (`masks.DocumentMasking`: a sliding window, global tokens + window, prefix-LM), built
on the whole sequence as every mask is. Labels are shifted on the FULL sequence,
before any context-parallel sharding: `labels[i] = tokens[i + 1]` when token i+1 is in the same
segment and is a target, else `IGNORE_INDEX` (the last token of a segment never predicts the
next document). Without packing, each sequence is one document, truncated or padded (the padding
is its own segment, with no targets).

Document order is a permutation per epoch drawn from `(seed, epoch)`, so the stream depends only
on the seed; `PackedStream.state_dict()` (epoch, document, offset, count) restores it exactly.
The stream plans from the documents' lengths alone: `skip()` moves past a sequence without
touching its documents, `next()` builds one, fetching only the documents it holds (so with
`flashcp.data.index.LazyItems` a process tokenizes only the documents of its own sequences).

`one_pass` (evaluation, `flashcp.evaluation`): the rows of one pass over the documents, each
document exactly once and whole. A document that does not fit the rest of a row starts the
next row (one longer than seq_len fills rows of its own, cut where a row ends), and the row that
takes the last document is padded instead of continuing into the next epoch, so a pass scores
every document once, with the context it would have alone (packed and unpacked eval agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from flashcp.config.schema import IGNORE_INDEX, Config
from flashcp.data.dataset import Document
from flashcp.masks import DocumentMasking, Mask


def document_masking(cfg: Config) -> DocumentMasking:
    """The mask each packed document gets under `cfg`'s `attention` section."""
    a = cfg.attention
    g = a.global_tokens if a.mask == "global_window" else 0
    return DocumentMasking(a.mask, a.sliding_window, g)


class Piece(NamedTuple):
    """Tokens `[start, start + length)` of document `doc` (an index into the stream's documents)."""

    doc: int
    start: int
    length: int


@dataclass(eq=False)
class PackedSequence:
    """One global sequence: tokens, target flags (per token), segment lengths and the prefix
    tokens each segment holds (its document's leading non-targets, `Document.prefix_len`)."""

    tokens: np.ndarray
    targets: np.ndarray
    doc_lens: list[int]
    prefix_lens: list[int] = field(default_factory=list)
    """One per segment (empty: none anywhere)."""


@dataclass
class StreamState:
    """Where the stream is: `epoch`, index into that epoch's order, offset inside the doc."""

    epoch: int = 0
    doc: int = 0
    offset: int = 0
    sequences: int = 0
    """Sequences produced so far (informational)."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([int(seed), int(epoch), 0x5EED]).permutation(n)


class PackedStream:
    """An endless, deterministic stream of `PackedSequence`s of length `seq_len`.

    `docs`: the documents, a list or any indexable with `lengths` (an array of their lengths,
    such as `flashcp.data.index.LazyItems`), so planning needs no document. `prefixes`: each
    document's prefix length (`Document.prefix_len`, e.g. from the index), which a piece's
    `piece_prefix` is cut from; None: no prefixes.
    """

    def __init__(
        self,
        docs: Sequence[Document] | Any,
        seq_len: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        packing: bool = True,
        pad_id: int = 0,
        prefixes: Any = None,
        one_pass: bool = False,
    ) -> None:
        if not len(docs):
            raise ValueError("PackedStream needs at least one document")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.docs = docs if hasattr(docs, "lengths") else list(docs)
        self.lengths = np.asarray(
            docs.lengths if hasattr(docs, "lengths") else [len(d) for d in self.docs],
            dtype=np.int64,
        )
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.packing = bool(packing)
        self.pad_id = int(pad_id)
        self.prefixes = None if prefixes is None else np.asarray(prefixes, dtype=np.int64)
        if self.prefixes is not None and self.prefixes.shape != self.lengths.shape:
            raise ValueError(f"prefixes {self.prefixes.shape} must give one per document "
                             f"{self.lengths.shape}")  # fmt: skip
        self.one_pass = bool(one_pass)
        """Rows of one pass: documents whole, no row crosses an epoch (module docstring)."""
        self.state = StreamState()
        self._order = _epoch_order(len(self.docs), self.seed, 0, self.shuffle)

    # -- position ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The stream position, JSON-serialisable."""
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state_dict()` was taken."""
        new = StreamState(**{k: int(v) for k, v in state.items()})
        if not 0 <= new.doc < len(self.docs):
            raise ValueError(
                f"data position {state} does not fit this dataset of {len(self.docs)} documents"
                " (was the checkpoint made with another data.path or tokenizer?)"
            )
        self.state = new
        self._order = _epoch_order(len(self.docs), self.seed, new.epoch, self.shuffle)

    def _advance_doc(self) -> None:
        self.state.doc += 1
        self.state.offset = 0
        if self.state.doc == len(self.docs):
            self.state.epoch += 1
            self.state.doc = 0
            self._order = _epoch_order(len(self.docs), self.seed, self.state.epoch, self.shuffle)

    # -- sequences --------------------------------------------------------------------------

    def next(self) -> PackedSequence:
        """The next sequence of the stream."""
        return self.build(self.plan_next())

    def skip(self) -> None:
        """Move past the next sequence without building it (another process's sequence)."""
        self.plan_next()

    def plan_next(self) -> list[Piece]:
        """The pieces of the next sequence, from the lengths alone; the stream moves past it."""
        pieces = self._next_packed() if self.packing else self._next_single()
        self.state.sequences += 1
        return pieces

    def piece_prefix(self, piece: Piece) -> int:
        """The prefix tokens of its document that `piece` holds (0 without prefixes)."""
        if self.prefixes is None:
            return 0
        return int(min(max(int(self.prefixes[piece.doc]) - piece.start, 0), piece.length))

    def build(self, pieces: Sequence[Piece]) -> PackedSequence:
        """The sequence made of `pieces` (back to back; unpacked: the one document, padded; a
        `one_pass` row that ends the pass: padded after its last piece)."""
        prefixes = [self.piece_prefix(p) for p in pieces] if self.prefixes is not None else []
        if not self.packing:
            (i, _, n) = pieces[0]
            doc = self.docs[i]
            tokens = np.full(self.seq_len, self.pad_id, dtype=np.int64)
            targets = np.zeros(self.seq_len, dtype=bool)
            tokens[:n] = doc.tokens[:n]
            targets[:n] = doc.targets[:n]
            lens = [n] if n == self.seq_len else [n, self.seq_len - n]
            return PackedSequence(tokens, targets, lens, prefixes + [0] * (len(lens) - 1))
        tokens, targets = [], []
        for i, start, take in pieces:
            doc = self.docs[i]
            tokens.append(doc.tokens[start : start + take])
            targets.append(doc.targets[start : start + take])
        lens = [p.length for p in pieces]
        if (pad := self.seq_len - sum(lens)) > 0:  # a one-pass row: the rest is padding
            tokens.append(np.full(pad, self.pad_id, dtype=np.int64))
            targets.append(np.zeros(pad, dtype=bool))
            lens.append(pad)
            prefixes = prefixes + [0] if prefixes else prefixes
        return PackedSequence(np.concatenate(tokens), np.concatenate(targets), lens, prefixes)

    def _next_packed(self) -> list[Piece]:
        pieces: list[Piece] = []
        space = self.seq_len
        epoch = self.state.epoch
        while space:
            if self.one_pass and self.state.epoch != epoch:
                break  # the pass is over: pad the row rather than start the next epoch
            i = int(self._order[self.state.doc])
            start = self.state.offset
            left = int(self.lengths[i]) - start
            if self.one_pass and pieces and left > space:
                break  # a document that does not fit the rest of the row starts the next row
            take = min(left, space)
            pieces.append(Piece(i, start, take))
            space -= take
            self.state.offset += take
            if self.state.offset == int(self.lengths[i]):
                self._advance_doc()
        return pieces

    def _next_single(self) -> list[Piece]:
        i = int(self._order[self.state.doc])
        self._advance_doc()
        return [Piece(i, 0, min(int(self.lengths[i]), self.seq_len))]


def shift_labels(tokens: np.ndarray, targets: np.ndarray, doc_lens: Sequence[int]) -> np.ndarray:
    """Next-token labels of one full sequence: IGNORE_INDEX at segment ends and non-targets."""
    n = int(tokens.shape[0])
    if sum(doc_lens) != n:
        raise ValueError(f"doc_lens {list(doc_lens)} sum to {sum(doc_lens)}, not {n}")
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(targets[1:], tokens[1:], IGNORE_INDEX)
    ends = np.cumsum(doc_lens) - 1
    labels[ends] = IGNORE_INDEX
    return labels


@dataclass(eq=False)
class Batch:
    """A micro-batch of full (global) sequences, ready to shard (`flashcp.cp.shard`).

    `input_ids`, `labels`, `positions`: int64 `[B, S]`; `mask`: the global FlashMask
    `[B, 1, S, C]` of its segments (causal documents `[B, 1, S, 1]` by default, `collate`);
    `doc_lens`: segment lengths per row (padding included).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    mask: Mask
    doc_lens: list[list[int]] = field(default_factory=list)

    @property
    def num_targets(self) -> int:
        """Positions with a label (not IGNORE_INDEX)."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def collate(
    seqs: Sequence[PackedSequence],
    *,
    pad_to: int | None = None,
    pad_id: int = 0,
    masking: DocumentMasking | None = None,
) -> Batch:
    """Stack sequences into a `Batch` whose mask gives each segment the `masking` mask (default
    causal documents); `pad_to` appends a padding segment (parallel.pad, no prefix)."""
    masking = masking or DocumentMasking()
    rows_tok, rows_lab, rows_lens, rows_pre = [], [], [], []
    for s in seqs:
        tokens, labels, lens = s.tokens, shift_labels(s.tokens, s.targets, s.doc_lens), s.doc_lens
        prefixes = list(s.prefix_lens) or [0] * len(lens)
        n = int(tokens.shape[0])
        if pad_to is not None and pad_to > n:
            extra = pad_to - n
            tokens = np.concatenate([tokens, np.full(extra, pad_id, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(extra, IGNORE_INDEX, dtype=np.int64)])
            lens, prefixes = [*lens, extra], [*prefixes, 0]
        rows_tok.append(tokens)
        rows_lab.append(labels)
        rows_lens.append([int(x) for x in lens])
        rows_pre.append([int(x) for x in prefixes])
    input_ids = np.stack(rows_tok).astype(np.int64)
    b, s = input_ids.shape
    positions = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
    return Batch(
        input_ids=input_ids,
        labels=np.stack(rows_lab).astype(np.int64),
        positions=positions,
        mask=masking.build(rows_lens, rows_pre),
        doc_lens=rows_lens,
    )
