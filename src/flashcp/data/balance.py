"""Work-balanced packing: every row of an optimizer step costs about the same.

First-fit packing (`flashcp.data.packing`, `flashcp.data.dpo_packing`) fills rows in stream
order, so one row may hold a single 30K-token document (~(30K)²/2 attention pairs) and another
twenty 1.5K-token ones (20× less), and every step waits for its slowest data-parallel rank. With
`data.balance: work` the data sources re-pack, window by window, the very tokens first-fit would
train on:

1. A window is the next `data.balance_window` steps of first-fit rows (`rows_per_step` = dp ×
   grad_accum × micro_batch_size each), fewer where an epoch ends (`epoch_window`: the one
   step where first-fit mixes two epochs is a window of its own, so no document moves into
   another epoch's steps). Its documents (pieces of one document inside the window merged
   again; a document longer than a row cut into whole rows and the rest) or DPO examples
   (never split) are the window's items.
2. `fill_rows`: the items, heaviest first (attention pairs from the work model,
   `flashcp.cp.work`), each go to a row. The window's `steps × rows_per_step` heaviest items
   anchor one row each, step by step, so the heaviest documents share a step; every other
   item goes to the row furthest below the heaviest row of its own step that has room for it
   (a document that fits nowhere is cut to fill the largest gap, as first-fit cuts one at a
   row's end). LM rows come out exactly full: the window holds exactly its rows' tokens.
3. A step's rows are dealt to micro-batches and dp ranks in order (`StepLayout`), as
   first-fit's are: with rows of equal work every split is balanced.

The plan depends on the lengths, `(train.seed, epoch)` and rows_per_step only, not on how the
rows split into dp ranks and micro-batches (dp = 2, micro_batch_size = 1 trains on exactly the
rows of dp = 1, micro_batch_size = 2); the same documents are seen per window and so per
epoch, none dropped or duplicated. A data source's state is the first-fit position where its
window began plus the steps it has handed out of it (`window_step`), so a resume re-plans the
window and continues exactly. With one row per step there is nothing to balance: the stream
stays first-fit.

`step_balance` reports a step's modelled imbalance (`balance/...` in metrics.jsonl) and
`step_report` what `flashcp data-stats` prints.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from flashcp.cp.balance import imbalance
from flashcp.cp.work import WorkModel, causal_pairs
from flashcp.data.packing import PackedStream, Piece

T = TypeVar("T")
_NEVER = np.iinfo(np.int64).max
"""A row's priority where the item may not go."""


@dataclass(frozen=True)
class StepLayout:
    """How a step's rows are split: `dp` ranks × `grad_accum` micro-batches × `micro_batch_size`
    rows. Rows are listed micro-batch by micro-batch, rank by rank within one (the order every
    data source hands them out in: dp rank r takes rows `[r·mbs, (r+1)·mbs)` of each
    micro-batch)."""

    dp: int
    grad_accum: int
    micro_batch_size: int

    @property
    def rows(self) -> int:
        """Rows per optimizer step, the whole job."""
        return self.dp * self.grad_accum * self.micro_batch_size

    def row(self, micro: int, rank: int, j: int) -> int:
        """Index of row `j` of dp rank `rank`'s micro-batch `micro` in the step's list."""
        return (micro * self.dp + rank) * self.micro_batch_size + j


@dataclass(frozen=True)
class Row:
    """A planned row: its segment lengths (documents or DPO examples, then any padding) and
    their visible attention pairs (`flashcp.cp.work`)."""

    lengths: tuple[int, ...]
    pairs: int
    padding: int = 0
    """Padding tokens at its end (counted in `pairs` as the causal segment they form)."""


# -- the window's rows ---------------------------------------------------------------------


def fill_rows(
    items: Sequence[Piece],
    costs: Sequence[int],
    *,
    steps: int,
    rows_per_step: int,
    row_len: int,
    cost_of: Callable[[Piece], int] | None = None,
) -> list[list[Piece]] | None:
    """The window's items in `steps × rows_per_step` rows of at most `row_len` tokens, step by
    step (module docstring, step 2). `costs[i]` is item i's attention pairs; `cost_of(piece)`
    those of a piece cut from an item, for items that may be cut (None: items are never cut,
    and the result is None when one fits no row). Deterministic: ties go to the longer, then the
    earlier item and to the lower row; each row's pieces are in item order."""
    n_rows = steps * rows_per_step
    free = np.full(n_rows, row_len, dtype=np.int64)
    load = np.zeros(n_rows, dtype=np.int64)
    step_of = np.repeat(np.arange(steps), rows_per_step)
    top = np.zeros(steps, dtype=np.int64)  # each step's heaviest row
    placed: list[list[tuple[int, Piece]]] = [[] for _ in range(n_rows)]
    given = zip(items, costs, strict=True)
    heap = [(-int(c), -int(p.length), i, p) for i, (p, c) in enumerate(given)]
    heapq.heapify(heap)
    order = len(heap)
    anchors = 0
    while heap:
        neg_cost, _, seq, piece = heapq.heappop(heap)
        n = int(piece.length)
        if n > row_len:
            raise ValueError(f"item {piece} is longer than a row ({row_len} tokens)")
        if anchors < n_rows:  # an empty row of the next step to anchor
            r = anchors
            anchors += 1
        else:
            deficit = load - top[step_of]  # <= 0: below its step's heaviest row
            fits = free >= n
            if fits.any():
                r = int(np.argmin(np.where(fits, deficit, _NEVER)))
            elif cost_of is None:
                return None
            else:  # cut it: the largest gap takes what it holds, the rest goes back
                widest = free == free.max()
                r = int(np.argmin(np.where(widest, deficit, _NEVER)))
                take = int(free[r])
                if not take:
                    raise ValueError(f"the items hold more than {n_rows} rows of {row_len} tokens")
                rest = Piece(piece.doc, piece.start + take, n - take)
                heapq.heappush(heap, (-int(cost_of(rest)), -rest.length, order, rest))
                order += 1
                piece, n = Piece(piece.doc, piece.start, take), take
                neg_cost = -int(cost_of(piece))
        placed[r].append((seq, piece))
        free[r] -= n
        load[r] += -neg_cost
        top[step_of[r]] = max(top[step_of[r]], load[r])
    return [[p for _, p in sorted(row)] for row in placed]


def window_items(rows: Sequence[Sequence[Piece]], row_len: int) -> list[Piece]:
    """The documents of first-fit `rows` as the balancer's items: pieces of one document that
    follow each other merged, a document longer than `row_len` cut into whole rows and the rest
    (each whole row one piece, as first-fit lays out a long document's middle), in stream
    order."""
    merged: list[Piece] = []
    for row in rows:
        for p in row:
            last = merged[-1] if merged else None
            if last is not None and last.doc == p.doc and last.start + last.length == p.start:
                merged[-1] = Piece(p.doc, last.start, last.length + p.length)
            else:
                merged.append(Piece(*p))
    out: list[Piece] = []
    for p in merged:
        start, n = p.start, p.length
        while n > row_len:
            out.append(Piece(p.doc, start, row_len))
            start, n = start + row_len, n - row_len
        out.append(Piece(p.doc, start, n))
    return out


# -- LM data: a window-balanced plan over the first-fit stream ------------------------------


def epoch_window(
    plan_row: Callable[[], tuple[T, int, int]],
    save: Callable[[], Any],
    restore: Callable[[Any], None],
    *,
    steps: int,
    rows_per_step: int,
) -> list[list[T]]:
    """Up to `steps` steps of first-fit rows that stay inside one epoch. `plan_row()` gives the
    next row with the epochs of its first and last token; the step in which the epoch turns
    (first-fit's one mixed step) forms a window of its own, so a document never moves into
    another epoch's steps (`save` / `restore` the position to put such a step back)."""
    window: list[list[T]] = []
    epoch = None
    for k in range(steps):
        saved = save()
        step, epochs = [], set()
        for _ in range(rows_per_step):
            row, first, last = plan_row()
            step.append(row)
            epochs |= {first, last}
        epoch = min(epochs) if epoch is None else epoch
        if epochs != {epoch}:
            if k == 0:
                window.append(step)
            else:
                restore(saved)
            break
        window.append(step)
    return window


def causal_piece_pairs(piece: Piece) -> int:
    """Visible pairs of a causal document piece (the default mask's)."""
    return int(causal_pairs(piece.length))


def balance_window(
    steps: list[list[list[Piece]]],
    row_len: int,
    pairs: Callable[[Piece], int] = causal_piece_pairs,
) -> list[list[Piece]]:
    """The rows of a window of first-fit LM `steps`, re-packed (module docstring), step by
    step: the same tokens, each row exactly `row_len` long; `pairs(piece)` weighs a piece (its
    visible attention pairs under the run's mask, `flashcp.data.loader.TrainData.piece_pairs`)."""
    items = window_items([row for step in steps for row in step], row_len)
    costs = [pairs(p) for p in items]
    rows = len(steps[0])
    filled = fill_rows(items, costs, steps=len(steps), rows_per_step=rows, row_len=row_len,
                       cost_of=pairs)  # fmt: skip
    assert filled is not None  # pieces may be cut, so they always fit
    return filled


class BalancedPlan:
    """Steps of `rows_per_step` rows (lists of `Piece`s), window by window over the first-fit
    `stream` (module docstring): `next_step()` hands out one step's rows, weighed by `pairs`
    (a piece's visible attention pairs; default: a causal document's)."""

    def __init__(
        self,
        stream: PackedStream,
        rows_per_step: int,
        window: int,
        *,
        pairs: Callable[[Piece], int] = causal_piece_pairs,
    ) -> None:
        if window < 1:
            raise ValueError(f"data.balance_window must be >= 1, got {window}")
        self.stream = stream
        self.pairs = pairs
        self.rows_per_step = int(rows_per_step)
        self.window = int(window)
        self.start = stream.state_dict()
        """The first-fit position where the current window began."""
        self.step = 0
        """Steps of the current window handed out."""
        self._rows: list[list[Piece]] = []

    def _row(self) -> tuple[list[Piece], int, int]:
        """The next first-fit row, with the epochs of its first and last token."""
        first = self.stream.state.epoch
        row = self.stream.plan_next()
        state = self.stream.state
        ended = state.doc == 0 and state.offset == 0  # it ended exactly with its epoch
        return row, first, state.epoch - (1 if ended else 0)

    def _plan(self) -> None:
        """Plan the window that starts at the stream's position."""
        self.start = self.stream.state_dict()
        steps = epoch_window(
            self._row,
            self.stream.state_dict,
            self.stream.load_state_dict,
            steps=self.window,
            rows_per_step=self.rows_per_step,
        )
        self._rows = balance_window(steps, self.stream.seq_len, self.pairs)

    def next_step(self) -> list[list[Piece]]:
        """The next step's rows (dealt to micro-batches and dp ranks in `StepLayout` order)."""
        rows = self.rows_per_step
        if self.step * rows == len(self._rows):
            self._plan()
            self.step = 0
        out = self._rows[self.step * rows : (self.step + 1) * rows]
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"stream": dict(self.start), "window_step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-plan the saved window and continue after its `window_step` steps (a state without
        one, from a first-fit run, starts a window at its position)."""
        self.stream.load_state_dict(state["stream"])
        self.start = self.stream.state_dict()
        self._rows = []
        self.step = 0
        done = int(state.get("window_step", 0))
        if done:
            self._plan()
            self.step = done


# -- metrics and reports -------------------------------------------------------------------


def step_balance(
    rows: Sequence[Row], layout: StepLayout, model: WorkModel, seq_len: int
) -> dict[str, float]:
    """A step's modelled imbalance (max / mean of FLOPs, `flashcp.cp.work`): over the dp ranks
    (`balance/dp_work_max_over_mean`) and over all its micro-batches
    (`balance/microbatch_work_max_over_mean`); rows in hand-out order."""
    flops = model.flops(seq_len, [r.pairs for r in rows]).reshape(
        layout.grad_accum, layout.dp, layout.micro_batch_size
    )
    return {
        "balance/dp_work_max_over_mean": imbalance(flops.sum(axis=(0, 2))),
        "balance/microbatch_work_max_over_mean": imbalance(flops.sum(axis=2).reshape(-1)),
    }


def step_report(
    step: int, rows: Sequence[Row], layout: StepLayout, model: WorkModel, seq_len: int
) -> dict[str, Any]:
    """One step as `flashcp data-stats --json` prints it: per dp rank and micro-batch the
    segment lengths of each row, modelled FLOPs at every level, and the imbalance."""
    flops = model.flops(seq_len, [r.pairs for r in rows])
    ranks = []
    for rank in range(layout.dp):
        micro = []
        for k in range(layout.grad_accum):
            idx = [layout.row(k, rank, j) for j in range(layout.micro_batch_size)]
            micro.append(
                {
                    "rows": [list(rows[i].lengths) for i in idx],
                    "padding": [rows[i].padding for i in idx],
                    "pairs": [rows[i].pairs for i in idx],
                    "work": float(flops[idx].sum()),
                }
            )
        ranks.append(
            {"dp_rank": rank, "micro_batches": micro, "work": sum(m["work"] for m in micro)}
        )
    return {"step": step, "ranks": ranks, **step_balance(rows, layout, model, seq_len)}
