"""The DPO recipe's data: preference pairs packed into rows, a deterministic, resumable stream.

The records (`data.path`, JSON Lines or Parquet, or the built-in set) are indexed once by all
ranks together (`flashcp.data.index`: each tokenizes its share of the records; every rank gets
every example's packed length and the bad-record report). Each epoch the examples are put in
an order drawn from `(train.seed, epoch)` (or file order with `data.shuffle: false`) and packed
first-fit, in that order, into rows of `data.seq_len` tokens with the share-question layout
(`flashcp.data.dpo`): the prompt once, each answer continuing from it with restarting
positions, several examples per row (`data.packing: false`: one example per row). The packing
needs only the lengths, so every rank plans the same rows. A step consumes `grad_accum × dp ×
micro_batch_size` rows, dp rank r taking rows `[r·mbs, (r+1)·mbs)` of each micro-batch and
tokenizing only the examples in them, so `dp = 2, micro_batch_size = 1` trains on exactly the
rows of `dp = 1, micro_batch_size = 2`. The position (epoch, row) is the whole state: every
rank holds the same one and rank 0 saves it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.config import Config
from flashcp.config.recipes import DPOConfig
from flashcp.data.dpo import (
    DEFAULT_DPO_DATA,
    DPOBatch,
    DPOExample,
    DPORecords,
    assign_rows,
    collate_packed,
)
from flashcp.data.index import BadRecords, LazyItems, RowIndex, build_index
from flashcp.data.loader import check_vocab
from flashcp.data.peers import Peers
from flashcp.data.sources import JsonlSource, RowSource, open_source
from flashcp.data.tokenizer import Tokenizer, build_tokenizer


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The example order of `epoch` (a permutation drawn from seed and epoch, or 0..n-1)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([int(seed), int(epoch), 0xD90]).permutation(n)


class DPOData:
    """Packed DPO micro-batches for dp rank `dp_rank` of `dp_size` (see the module docstring)."""

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
        self.dpo: DPOConfig = cfg.extras.get("dpo") or DPOConfig()
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.tokenizer = tokenizer or build_tokenizer(d.tokenizer)
        check_vocab(cfg, self.tokenizer)
        divisor = cfg.parallel.seq_divisor
        padded = -(-d.seq_len // divisor) * divisor
        self.seq_len = padded if cfg.parallel.pad else d.seq_len
        """Length of the rows the model sees (after parallel.pad)."""
        self.source: RowSource = (
            JsonlSource([DEFAULT_DPO_DATA], "built-in preference set")
            if d.path is None
            else open_source(d.path, cache_dir=d.cache_dir, peers=peers)
        )
        build = DPORecords(
            self.tokenizer,
            budget=d.seq_len,
            truncation=self.dpo.truncation,
            max_prompt_len=self.dpo.max_prompt_len,
            prompt_field=d.prompt_field,
            chosen_field=d.chosen_field,
            rejected_field=d.rejected_field,
        )
        self.index: RowIndex = build_index(
            self.source,
            lambda r: build(r).packed_len,
            peers=peers,
            on_bad_record=d.on_bad_record,
        )
        self.examples: LazyItems[DPOExample] = LazyItems(
            self.source, self.index, build, lambda e: e.packed_len
        )
        """The examples, each tokenized when a batch of this rank first holds it."""
        self.epoch = 0
        self.row = 0
        self._rows = self._epoch_rows(0)

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        d = self.cfg.data
        order = epoch_order(len(self.examples), self.cfg.train.seed, epoch, d.shuffle)
        if not d.packing:
            return [[int(i)] for i in order]
        lengths = self.index.lengths[order].tolist()
        return [[int(order[j]) for j in row] for row in assign_rows(lengths, self.seq_len)]

    def _next_row(self) -> list[int]:
        if self.row == len(self._rows):
            self.epoch += 1
            self.row = 0
            self._rows = self._epoch_rows(self.epoch)
        out = self._rows[self.row]
        self.row += 1
        return out

    def next_step(self) -> list[DPOBatch]:
        """This dp rank's `train.grad_accum` micro-batches for the next optimizer step."""
        mbs = self.cfg.data.micro_batch_size
        pad_id = int(self.tokenizer.pad_id)
        out = []
        for _ in range(self.cfg.train.grad_accum):
            rows = [self._next_row() for _ in range(self.dp_size * mbs)]
            mine = rows[self.dp_rank * mbs : (self.dp_rank + 1) * mbs]
            out.append(collate_packed(self.examples, mine, self.seq_len, pad_id=pad_id))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "row": self.row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, row = int(state["epoch"]), int(state["row"])
        rows = self._epoch_rows(epoch)
        if not 0 <= row <= len(rows):
            raise ValueError(
                f"DPO data position {state} does not fit this dataset ({len(rows)} rows in "
                f"epoch {epoch}; was the checkpoint made with another data.path or seq_len?)"
            )
        self.epoch, self.row, self._rows = epoch, row, rows

    @property
    def bad_records(self) -> BadRecords:
        """The records left out, by reason (`data.on_bad_record: skip`)."""
        return self.index.bad

    def describe(self) -> str:
        rows = len(self._rows)
        out = (
            f"data {self.source.name}: {self.num_examples} preference pairs in {rows} packed "
            f"rows (~{self.num_examples / max(rows, 1):.1f} per row)"
        )
        skipped = self.bad_records.summary()
        return f"{out} ({skipped})" if skipped else out

    def data_report(self) -> dict[str, Any]:
        """What the data is, for run_info.json: records, usable pairs, bad records."""
        return {
            "source": self.source.name,
            "rows": self.index.total_rows,
            "examples": self.num_examples,
            "tokens": int(self.index.lengths.sum()),
            "bad_records": self.bad_records.as_dict(),
        }
