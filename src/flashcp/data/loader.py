"""The training data of one rank: a step's micro-batches of one global stream.

Rows come from `data.path` (JSON Lines or Parquet, `flashcp.data.sources`) or the shipped
sets, and are indexed once by all processes together (`flashcp.data.index`: each reads and
tokenizes its share of the rows, every process gets every row's length and the bad-record
report). Every rank then plans the same deterministic `PackedStream` from the lengths (with
`data.balance: work` re-packed window by window so that the rows of a step cost the same,
`flashcp.data.balance`); a step consumes `grad_accum × dp × micro_batch_size` sequences, and
dp rank r takes sequences `[r·mbs, (r+1)·mbs)` of each micro-batch, building (tokenizing) only
the rows those hold and skipping the others'. CP and PP ranks of one dp rank build the same
full sequences (CP shards them afterwards). So `dp=2, micro_batch_size=1` sees exactly the
sequences of `dp=1, micro_batch_size=2`, and the data position is identical on every rank
(rank 0 saves it; resuming restores it exactly).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.config.schema import Config
from flashcp.cp.work import WorkModel, document_pairs
from flashcp.data import formats
from flashcp.data.balance import BalancedPlan, Row, StepLayout, step_balance
from flashcp.data.dataset import Document, DocumentBuilder, builtin_sft_records
from flashcp.data.index import BadRecords, LazyItems, RowIndex, build_index
from flashcp.data.packing import Batch, PackedStream, Piece, collate, document_masking
from flashcp.data.peers import Peers
from flashcp.data.sources import (
    BUILTIN_CORPUS,
    JsonlSource,
    ListSource,
    RowSource,
    SampleSource,
    open_source,
)
from flashcp.data.tokenizer import Tokenizer, build_tokenizer


def check_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    """The tokenizer's ids must fit the model's embedding."""
    vocab = int(getattr(cfg.model, "vocab_size", tokenizer.vocab_size))
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
            f"{vocab}: set model.vocab_size >= {tokenizer.vocab_size}"
        )


def lm_source(cfg: Config, peers: Peers | None = None) -> RowSource:
    """The rows of the pretrain/sft data: `data.path`, or the shipped corpus / instruction
    set."""
    d = cfg.data
    if d.path is not None:
        return open_source(d.path, cache_dir=d.cache_dir, peers=peers)
    if formats.examples_of(cfg.run.recipe) == "supervised":
        return ListSource(
            builtin_sft_records(d.prompt_field, d.response_field), "built-in instruction set"
        )
    return JsonlSource([BUILTIN_CORPUS], "built-in corpus")


class TrainData:
    """Micro-batches for dp rank `dp_rank` of `dp_size`, from the config's data section.

    `peers`: the processes indexing the rows together (default: this one alone, which reads
    every row once to index it). `one_pass`: the rows of one pass over the data, each document
    once and whole (an eval set: `PackedStream`'s `one_pass`). `sample`: read only that many
    rows, spread over the data (`SampleSource`; a preflight's check).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        tokenizer: Tokenizer | None = None,
        peers: Peers | None = None,
        one_pass: bool = False,
        sample: int | None = None,
    ) -> None:
        d = cfg.data
        self.cfg = cfg
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.tokenizer = tokenizer or build_tokenizer(d.tokenizer)
        check_vocab(cfg, self.tokenizer)
        self.source = lm_source(cfg, peers)
        if sample is not None:  # a preflight's look at the data: rows in a format it reads
            self.source = SampleSource(self.source, sample)
            formats.check_data(cfg, self.source)
        self.masking = document_masking(cfg)
        """The mask each packed document gets (`attention.mask`)."""
        build = DocumentBuilder(
            self.tokenizer,
            recipe=cfg.run.recipe,
            text_field=d.text_field,
            prompt_field=d.prompt_field,
            response_field=d.response_field,
            messages_field=d.messages_field,
            max_len=None if d.packing else d.seq_len,
            format=d.format,
            prefix_len=cfg.attention.prefix_len if self.masking.uses_prefixes else None,
        )
        prefixed = self.masking.uses_prefixes  # index each document's prefix with its length
        self.index: RowIndex = build_index(
            self.source,
            (lambda r: (len(doc := build(r)), doc.prefix_len)) if prefixed
            else (lambda r: len(build(r))),
            peers=peers,
            on_bad_record=d.on_bad_record,
            columns=2 if prefixed else 1,
        )  # fmt: skip
        self.docs: LazyItems[Document] = LazyItems(self.source, self.index, build, len)
        self.num_documents = len(self.index)
        self.num_tokens = int(self.index.lengths.sum())
        extra = self.index.extra
        self.stream = PackedStream(
            self.docs,
            d.seq_len,
            seed=cfg.train.seed,
            shuffle=d.shuffle,
            packing=d.packing,
            pad_id=self.tokenizer.pad_id,
            prefixes=extra[:, 0] if prefixed and extra is not None else None,
            one_pass=one_pass,
        )
        divisor = cfg.parallel.seq_divisor
        padded = -(-d.seq_len // divisor) * divisor
        self.pad_to = padded if cfg.parallel.pad and padded != d.seq_len else None
        self.layout = StepLayout(self.dp_size, cfg.train.grad_accum, d.micro_batch_size)
        self.plan: BalancedPlan | None = None
        """The work-balanced plan (`data.balance: work`, packed, > 1 row per step), else None:
        first-fit rows straight from the stream."""
        if d.balance == "work" and d.packing and self.layout.rows > 1:
            self.plan = BalancedPlan(
                self.stream, self.layout.rows, d.balance_window, pairs=self.piece_pairs
            )
        self.work = WorkModel.for_model(cfg.model, lora=cfg.extras.get("lora") is not None)
        """The work model of `balance_metrics` (`flashcp.cp.work`)."""
        self._last: list[list[Piece]] = []

    @property
    def seq_len(self) -> int:
        """Length of the sequences the model sees (after parallel.pad, if any)."""
        return self.pad_to or self.cfg.data.seq_len

    @property
    def rows_per_epoch(self) -> float:
        """Rows (sequences) of one pass over the data: packed, its real tokens over seq_len
        (documents continue across rows); unpacked, one row per document."""
        if self.cfg.data.packing:
            return self.num_tokens / self.cfg.data.seq_len
        return float(self.num_documents)

    @property
    def bad_records(self) -> BadRecords:
        """The rows left out, by reason (`data.on_bad_record: skip`)."""
        return self.index.bad

    def step_rows(self) -> list[list[Piece]]:
        """Every row of the next step (the whole job's, in `StepLayout` order), planned from
        the lengths alone; the stream moves past them."""
        if self.plan is not None:
            rows = self.plan.next_step()
        else:
            rows = [self.stream.plan_next() for _ in range(self.layout.rows)]
        self._last = rows
        return rows

    def next_step(self) -> list[Batch]:
        """This dp rank's `train.grad_accum` micro-batches for the next optimizer step."""
        rows = self.step_rows()
        out = []
        for k in range(self.layout.grad_accum):
            mine = [
                self.stream.build(rows[self.layout.row(k, self.dp_rank, j)])
                for j in range(self.layout.micro_batch_size)
            ]
            out.append(collate(
                mine, pad_to=self.pad_to, pad_id=self.tokenizer.pad_id, masking=self.masking
            ))  # fmt: skip
        return out

    def piece_pairs(self, piece: Piece) -> int:
        """Visible attention pairs of `piece` as one segment under the run's mask
        (`flashcp.cp.work.document_pairs`): what the balancer weighs it by."""
        prefix = self.stream.piece_prefix(piece)
        return int(document_pairs(self.masking, piece.length, prefix))

    def row_info(self, pieces: list[Piece]) -> Row:
        """A planned row's segments as the model sees them (padding included) and their pairs."""
        lengths = [p.length for p in pieces]
        real, length = sum(lengths), self.cfg.data.seq_len
        padding = [length - real] if real < length else []  # unpacked: its padding
        if self.pad_to is not None:  # parallel.pad: one more segment (`collate`)
            padding.append(self.pad_to - length)
        pairs = sum(self.piece_pairs(p) for p in pieces)
        pairs += int(document_pairs(self.masking, np.asarray(padding, dtype=np.int64)).sum())
        return Row(tuple(lengths), pairs, self.seq_len - real)

    def balance_metrics(self) -> dict[str, float]:
        """The last step's modelled imbalance (`flashcp.data.balance.step_balance`)."""
        if not self._last:
            return {}
        rows = [self.row_info(r) for r in self._last]
        return step_balance(rows, self.layout, self.work, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        if self.plan is not None:
            return self.plan.state_dict()
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.plan is not None:
            self.plan.load_state_dict(state)
        else:
            self.stream.load_state_dict(state["stream"])

    def data_report(self) -> dict[str, Any]:
        """What the data is, for run_info.json: rows, usable documents, tokens, bad records."""
        return {
            "source": self.source.name,
            "rows": self.index.total_rows,
            "documents": self.num_documents,
            "tokens": self.num_tokens,
            "bad_records": self.bad_records.as_dict(),
        }
