"""The DPO recipe's data: preference pairs packed into rows, a deterministic, resumable stream.

The records (`data.path`, JSON Lines or Parquet, or the built-in set) are indexed once by all
ranks together (`flashcp.data.index`: each tokenizes its share of the records; every rank gets
every example's packed length and the bad-record report). Each epoch the examples are put in
an order drawn from `(train.seed, epoch)` (or file order with `data.shuffle: false`) and packed
first-fit, in that order, into rows of `data.seq_len` tokens with the share-question layout
(`flashcp.data.dpo_packing`): the prompt once, each answer continuing from it with restarting
positions, several examples per row (`data.packing: false`: one example per row). The packing
needs only the lengths, so every rank plans the same rows. A step consumes `grad_accum × dp ×
micro_batch_size` rows, dp rank r taking rows `[r·mbs, (r+1)·mbs)` of each micro-batch and
tokenizing only the examples in them, so `dp = 2, micro_batch_size = 1` trains on exactly the
rows of `dp = 1, micro_batch_size = 2`. The position (epoch, row) is the whole state: every
rank holds the same one and rank 0 saves it. With `data.balance: work` the examples of each
window of first-fit rows are re-packed so that the rows of a step cost about the same
(`flashcp.data.balance`; an example never splits); the state is then the first-fit position
where the window began and the steps handed out of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.config import Config
from flashcp.config.recipes import DPOConfig
from flashcp.cp.work import WorkModel, causal_pairs, share_question_pairs
from flashcp.data import formats
from flashcp.data.balance import (
    Row,
    StepLayout,
    epoch_window,
    fill_rows,
    step_balance,
)
from flashcp.data.dpo_packing import DPOBatch, assign_rows, collate_packed
from flashcp.data.dpo_records import DPOExample, DPORecords
from flashcp.data.index import BadRecords, LazyItems, RowIndex, build_index
from flashcp.data.loader import check_vocab
from flashcp.data.packing import Piece
from flashcp.data.peers import Peers
from flashcp.data.sources import (
    BUILTIN_PREFERENCES,
    JsonlSource,
    RowSource,
    SampleSource,
    open_source,
)
from flashcp.data.tokenizer import Tokenizer, build_tokenizer


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The example order of `epoch` (a permutation drawn from seed and epoch, or 0..n-1)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([int(seed), int(epoch), 0xD90]).permutation(n)


class DPORows:
    """The packed rows of preference pairs, step by step, planned from the examples' sizes
    alone (every rank plans the same): first-fit rows per epoch (example order from `(seed,
    epoch)`), re-packed window by window when `balance_window` is given (module docstring).

    `lengths[i]`: example i's packed length; `pairs[i]`: the visible attention pairs of its
    share-question segments (`flashcp.cp.work.share_question_pairs`).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        pairs: np.ndarray,
        seq_len: int,
        *,
        rows_per_step: int,
        seed: int = 0,
        shuffle: bool = True,
        packing: bool = True,
        balance_window: int | None = None,
    ) -> None:
        self.lengths, self.pairs = np.asarray(lengths), np.asarray(pairs)
        self.seq_len, self.rows_per_step = int(seq_len), int(rows_per_step)
        self.seed, self.shuffle, self.packing = int(seed), bool(shuffle), bool(packing)
        self.window = balance_window if packing and self.rows_per_step > 1 else None
        """Steps per balanced window; None: first-fit rows as they come."""
        self.epoch = 0
        self.row = 0
        self._rows = self._epoch_rows(0)
        self.first_epoch_rows = len(self._rows)
        """First-fit rows of epoch 0 (a pass over the examples)."""
        self.start = (0, 0)
        """The first-fit (epoch, row) where the current window began."""
        self.window_step = 0
        """Steps of the current window handed out."""
        self._window: list[list[int]] = []

    @property
    def epoch_rows(self) -> int:
        """First-fit rows of the current epoch."""
        return len(self._rows)

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        order = epoch_order(len(self.lengths), self.seed, epoch, self.shuffle)
        if not self.packing:
            return [[int(i)] for i in order]
        lengths = self.lengths[order].tolist()
        return [[int(order[j]) for j in row] for row in assign_rows(lengths, self.seq_len)]

    def _next_row(self) -> list[int]:
        if self.row == len(self._rows):
            self.epoch += 1
            self.row = 0
            self._rows = self._epoch_rows(self.epoch)
        out = self._rows[self.row]
        self.row += 1
        return out

    def row_info(self, row: list[int]) -> Row:
        """A planned row: its examples' packed lengths and the pairs of its share-question mask
        (the trailing padding one more causal segment, as `collate_packed` lays it out)."""
        lengths = [int(self.lengths[i]) for i in row]
        padding = self.seq_len - sum(lengths)
        pairs = int(self.pairs[row].sum()) + int(causal_pairs(padding))
        return Row(tuple(lengths), pairs, padding)

    def _plan_window(self, steps: int) -> None:
        """Re-pack the examples of the next window of first-fit rows (`flashcp.data.balance`);
        if they do not fit its rows balanced, its first-fit rows go heaviest first."""
        n = self.rows_per_step
        self.start = (self.epoch, self.row)

        def row() -> tuple[list[int], int, int]:
            out = self._next_row()
            return out, self.epoch, self.epoch

        def restore(saved: tuple[int, int, list[list[int]]]) -> None:
            self.epoch, self.row, self._rows = saved

        window = epoch_window(
            row, lambda: (self.epoch, self.row, self._rows), restore, steps=steps, rows_per_step=n
        )
        first_fit = [r for step in window for r in step]
        items = [Piece(i, 0, int(self.lengths[i])) for r in first_fit for i in r]
        costs = [int(self.pairs[p.doc]) for p in items]
        filled = fill_rows(items, costs, steps=len(window), rows_per_step=n, row_len=self.seq_len)
        if filled is not None:
            self._window = [[p.doc for p in r] for r in filled]
        else:
            self._window = sorted(first_fit, key=lambda r: -self.row_info(r).pairs)

    def next_step(self) -> list[list[int]]:
        """Every row of the next step (example indices, dealt in `StepLayout` order)."""
        n = self.rows_per_step
        if self.window is None:
            return [self._next_row() for _ in range(n)]
        if self.window_step * n == len(self._window):
            self._plan_window(self.window)
            self.window_step = 0
        self.window_step += 1
        return self._window[(self.window_step - 1) * n : self.window_step * n]

    def state_dict(self) -> dict[str, Any]:
        if self.window is None:
            return {"epoch": self.epoch, "row": self.row}
        epoch, row = self.start
        return {"epoch": epoch, "row": row, "window_step": self.window_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state_dict()` was taken (a balanced plan re-plans its window)."""
        epoch, row = int(state["epoch"]), int(state["row"])
        rows = self._epoch_rows(epoch)
        if not 0 <= row <= len(rows):
            raise ValueError(
                f"DPO data position {state} does not fit this dataset ({len(rows)} rows in "
                f"epoch {epoch}; was the checkpoint made with another data.path or seq_len?)"
            )
        self.epoch, self.row, self._rows = epoch, row, rows
        self.start, self.window_step, self._window = (epoch, row), 0, []
        done = int(state.get("window_step", 0)) if self.window is not None else 0
        if done:
            self._plan_window(self.window)  # type: ignore[arg-type]
            self.window_step = done


class DPOData:
    """Packed DPO micro-batches for dp rank `dp_rank` of `dp_size` (see the module docstring).
    `one_pass` (an eval set) changes nothing: rows hold whole examples of one epoch already."""

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
        del one_pass  # an example is never split and no row crosses an epoch: one pass as is
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
            JsonlSource([BUILTIN_PREFERENCES], "built-in preference set")
            if d.path is None
            else open_source(d.path, cache_dir=d.cache_dir, peers=peers)
        )
        if sample is not None:  # a preflight's look at the data: rows in a format it reads
            self.source = SampleSource(self.source, sample)
            formats.check_data(cfg, self.source)
        build = DPORecords(
            self.tokenizer,
            budget=d.seq_len,
            truncation=self.dpo.truncation,
            max_prompt_len=self.dpo.max_prompt_len,
            prompt_field=d.prompt_field,
            chosen_field=d.chosen_field,
            rejected_field=d.rejected_field,
            format=d.format,
        )
        self.index: RowIndex = build_index(
            self.source,
            lambda r: _sizes(build(r)),
            peers=peers,
            on_bad_record=d.on_bad_record,
            columns=3,
        )
        self.examples: LazyItems[DPOExample] = LazyItems(
            self.source, self.index, build, lambda e: e.packed_len
        )
        """The examples, each tokenized when a batch of this rank first holds it."""
        self.layout = StepLayout(self.dp_size, cfg.train.grad_accum, d.micro_batch_size)
        assert self.index.extra is not None  # measured with the answers' lengths
        chosen, rejected = self.index.extra[:, 0], self.index.extra[:, 1]
        self.plan = DPORows(
            self.index.lengths,
            share_question_pairs(self.index.lengths - chosen - rejected, chosen, rejected),
            self.seq_len,
            rows_per_step=self.layout.rows,
            seed=cfg.train.seed,
            shuffle=d.shuffle,
            packing=d.packing,
            balance_window=d.balance_window if d.balance == "work" else None,
        )
        """The rows of every step (`DPORows`)."""
        self.work = WorkModel.for_model(
            cfg.model, lora=cfg.extras.get("lora") is not None, reference=True
        )
        """The work model of `balance_metrics` (`flashcp.cp.work`)."""
        self._last: list[list[int]] = []

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    @property
    def epoch(self) -> int:
        """The epoch the plan has reached."""
        return self.plan.epoch

    @property
    def rows_per_epoch(self) -> float:
        """Rows of one pass over the pairs: the first epoch's packed rows (an example is never
        split; a reshuffled epoch packs within a row or so of it)."""
        return float(self.plan.first_epoch_rows)

    def step_rows(self) -> list[list[int]]:
        """Every row of the next step (the whole job's, in `StepLayout` order): example
        indices, planned from the lengths alone; the position moves past them."""
        self._last = self.plan.next_step()
        return self._last

    def row_info(self, row: list[int]) -> Row:
        return self.plan.row_info(row)

    def next_step(self) -> list[DPOBatch]:
        """This dp rank's `train.grad_accum` micro-batches for the next optimizer step."""
        rows = self.step_rows()
        pad_id = int(self.tokenizer.pad_id)
        out = []
        for k in range(self.layout.grad_accum):
            mine = [
                rows[self.layout.row(k, self.dp_rank, j)]
                for j in range(self.layout.micro_batch_size)
            ]
            out.append(collate_packed(self.examples, mine, self.seq_len, pad_id=pad_id))
        return out

    def balance_metrics(self) -> dict[str, float]:
        """The last step's modelled imbalance (`flashcp.data.balance.step_balance`)."""
        if not self._last:
            return {}
        rows = [self.plan.row_info(r) for r in self._last]
        return step_balance(rows, self.layout, self.work, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return self.plan.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan.load_state_dict(state)

    @property
    def bad_records(self) -> BadRecords:
        """The records left out, by reason (`data.on_bad_record: skip`)."""
        return self.index.bad

    def describe(self) -> str:
        rows = self.plan.epoch_rows
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


def _sizes(example: DPOExample) -> tuple[int, int, int]:
    """What the index keeps of an example: its packed length and its answers' lengths."""
    return example.packed_len, len(example.chosen), len(example.rejected)
