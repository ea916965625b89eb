"""The training data of one rank: a step's micro-batches, the same stream on every rank.

Every rank runs the same deterministic `PackedStream`; a step consumes
`grad_accum × dp × micro_batch_size` sequences, and dp rank r takes sequences
`[r·mbs, (r+1)·mbs)` of each micro-batch. CP ranks of one dp rank get the same full sequences
(and shard them afterwards). So `dp=2, micro_batch_size=1` sees exactly the sequences of
`dp=1, micro_batch_size=2`, and the data position is identical on every rank (rank 0 saves it).
"""

from __future__ import annotations

from typing import Any

from flashcp.config.schema import Config
from flashcp.data.dataset import builtin_sft_records, read_records, tokenize_records
from flashcp.data.packing import Batch, PackedStream, collate
from flashcp.data.tokenizer import Tokenizer, build_tokenizer


class TrainData:
    """Micro-batches for dp rank `dp_rank` of `dp_size`, from the config's data section."""

    def __init__(
        self,
        cfg: Config,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        d = cfg.data
        self.cfg = cfg
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.tokenizer = tokenizer or build_tokenizer(d.tokenizer)
        vocab = int(getattr(cfg.model, "vocab_size", self.tokenizer.vocab_size))
        if self.tokenizer.vocab_size > vocab:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but model.vocab_size is "
                f"{vocab}: set model.vocab_size >= {self.tokenizer.vocab_size}"
            )
        if cfg.run.recipe == "sft" and d.path is None:
            records = builtin_sft_records(d.prompt_field, d.response_field)
        else:
            records = read_records(d.path)
        docs = tokenize_records(
            records,
            self.tokenizer,
            recipe=cfg.run.recipe,
            text_field=d.text_field,
            prompt_field=d.prompt_field,
            response_field=d.response_field,
            source=d.path
            or (
                "built-in instruction set" if cfg.run.recipe == "sft" else "built-in corpus"
            ),  # fmt: skip
        )
        self.num_documents = len(docs)
        self.num_tokens = sum(len(doc) for doc in docs)
        self.stream = PackedStream(
            docs,
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

    def next_step(self) -> list[Batch]:
        """This dp rank's `train.grad_accum` micro-batches for the next optimizer step."""
        mbs = self.cfg.data.micro_batch_size
        out = []
        for _ in range(self.cfg.train.grad_accum):
            seqs = [self.stream.next() for _ in range(self.dp_size * mbs)]
            mine = seqs[self.dp_rank * mbs : (self.dp_rank + 1) * mbs]
            out.append(collate(mine, pad_to=self.pad_to, pad_id=self.tokenizer.pad_id))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
