"""The training data of one rank: a step's micro-batches of one global stream.

Rows come from `data.path` (JSON Lines or Parquet, `flashcp.data.sources`) or the shipped
sets, and are indexed once by all processes together (`flashcp.data.index`: each reads and
tokenizes its share of the rows, every process gets every row's length and the bad-record
report). Every rank then plans the same deterministic `PackedStream` from the lengths; a step
consumes `grad_accum × dp × micro_batch_size` sequences, and dp rank r takes sequences
`[r·mbs, (r+1)·mbs)` of each micro-batch, building (tokenizing) only the rows those hold and
skipping the others'. CP and PP ranks of one dp rank build the same full sequences (CP shards
them afterwards). So `dp=2, micro_batch_size=1` sees exactly the sequences of
`dp=1, micro_batch_size=2`, and the data position is identical on every rank (rank 0 saves it;
resuming restores it exactly).
"""

from __future__ import annotations

from typing import Any

from flashcp.config.schema import Config
from flashcp.data.dataset import (
    DEFAULT_CORPUS,
    Document,
    DocumentBuilder,
    builtin_sft_records,
    default_corpus_text,
    parse_jsonl,
)
from flashcp.data.index import BadRecords, LazyItems, RowIndex, build_index
from flashcp.data.packing import Batch, PackedStream, collate
from flashcp.data.peers import Peers
from flashcp.data.sources import ListSource, RowSource, open_source
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
    if cfg.run.recipe == "sft":
        return ListSource(
            builtin_sft_records(d.prompt_field, d.response_field), "built-in instruction set"
        )
    records = parse_jsonl(default_corpus_text(), f"flashcp/data/{DEFAULT_CORPUS}")
    return ListSource(list(records), "built-in corpus")


class TrainData:
    """Micro-batches for dp rank `dp_rank` of `dp_size`, from the config's data section.

    `peers`: the processes indexing the rows together (default: this one alone, which reads
    every row once to index it).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        tokenizer: Tokenizer | None = None,
        peers: Peers | None = None,
    ) -> None:
        d = cfg.data
        self.cfg = cfg
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.tokenizer = tokenizer or build_tokenizer(d.tokenizer)
        check_vocab(cfg, self.tokenizer)
        self.source = lm_source(cfg, peers)
        build = DocumentBuilder(
            self.tokenizer,
            recipe=cfg.run.recipe,
            text_field=d.text_field,
            prompt_field=d.prompt_field,
            response_field=d.response_field,
            messages_field=d.messages_field,
            max_len=None if d.packing else d.seq_len,
        )
        self.index: RowIndex = build_index(
            self.source, lambda r: len(build(r)), peers=peers, on_bad_record=d.on_bad_record
        )
        self.docs: LazyItems[Document] = LazyItems(self.source, self.index, build, len)
        self.num_documents = len(self.index)
        self.num_tokens = int(self.index.lengths.sum())
        self.stream = PackedStream(
            self.docs,
            d.seq_len,
            seed=cfg.train.seed,
            shuffle=d.shuffle,
            packing=d.packing,
            pad_id=self.tokenizer.pad_id,
        )
        divisor = cfg.parallel.seq_divisor
        padded = -(-d.seq_len // divisor) * divisor
        self.pad_to = padded if cfg.parallel.pad and padded != d.seq_len else None

    @property
    def seq_len(self) -> int:
        """Length of the sequences the model sees (after parallel.pad, if any)."""
        return self.pad_to or self.cfg.data.seq_len

    @property
    def bad_records(self) -> BadRecords:
        """The rows left out, by reason (`data.on_bad_record: skip`)."""
        return self.index.bad

    def next_step(self) -> list[Batch]:
        """This dp rank's `train.grad_accum` micro-batches for the next optimizer step."""
        mbs = self.cfg.data.micro_batch_size
        lo, hi = self.dp_rank * mbs, (self.dp_rank + 1) * mbs
        out = []
        for _ in range(self.cfg.train.grad_accum):
            mine = []
            for j in range(self.dp_size * mbs):
                if lo <= j < hi:
                    mine.append(self.stream.next())
                else:
                    self.stream.skip()
            out.append(collate(mine, pad_to=self.pad_to, pad_id=self.tokenizer.pad_id))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
