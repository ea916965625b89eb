"""A dataset's index: the length of every usable row and a report of the bad ones.

Built once at the start, before training, by all processes together: of N rows, process k of
W reads, checks and tokenizes rows `[N·k // W, N·(k+1) // W)` (its contiguous share) and keeps
only their lengths; the shares are all-gathered (`Peers.gather`), so every process ends with the
same `RowIndex` (one int64 per row) without having read the others' rows. From the lengths alone
every process plans the same global sequence of training batches (`flashcp.data.packing`,
`flashcp.data.dpo_stream`) and then tokenizes only the rows in its own batches
(`LazyItems`) — the plan, and so the data position saved in checkpoints, is the same on every
rank and for every parallel layout.

Bad records (`flashcp.data.records.BadRecordError`) are counted by reason with their first few
locations. `data.on_bad_record: skip` leaves them out of the index and reports them
(`BadRecords.summary()`, in the trainer's start line); `error` stops every process before
training, naming the first bad row and its reason. A problem that is not one record's fault
(no chat template for message data, `dpo.truncation: error` on a too-long example) stops
every process the same way, with the row where it showed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from flashcp.data.peers import Peers
from flashcp.data.records import BadRecordError, DataError
from flashcp.data.sources import RowSource

T = TypeVar("T")
BAD_RECORD_POLICIES = ("skip", "error")
FIRST_ROWS = 5
"""Row locations kept per bad-record reason."""


@dataclass
class BadRecords:
    """Bad records by reason: how many, and where the first `FIRST_ROWS` are."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        rows = self.first.setdefault(reason, [])
        if len(rows) < FIRST_ROWS:
            rows.append(where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """`3 bad records skipped: empty answer ×2 (d.jsonl:4, d.jsonl:9); ...` ('' if none)."""
        if not self.counts:
            return ""
        parts = []
        for reason, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            rows = ", ".join(self.first[reason]) + (", ..." if n > len(self.first[reason]) else "")
            parts.append(f"{reason} ×{n} ({rows})")
        noun = "record" if self.total == 1 else "records"
        return f"{self.total} bad {noun} skipped: " + "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: `{"skipped": n, "reasons": {reason: {"count", "first"}}}`."""
        return {
            "skipped": self.total,
            "reasons": {
                r: {"count": n, "first": list(self.first[r])} for r, n in self.counts.items()
            },  # fmt: skip
        }


@dataclass
class RowIndex:
    """The usable rows of a source in row order: `rows[i]` is item i's row, `lengths[i]` its
    size in tokens (what the batch planner needs)."""

    rows: np.ndarray
    lengths: np.ndarray
    total_rows: int
    bad: BadRecords
    extra: np.ndarray | None = None
    """`[len, columns - 1]` further sizes the measure gave per item (DPO: the answers'
    lengths, which the work model needs), None when it gave the length alone."""

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@dataclass
class _Share:
    lo: int
    lengths: np.ndarray  # [hi - lo, columns]
    bad: list[tuple[int, str, str, str]]  # (row, where, reason, detail)
    fatal: tuple[int, str] | None  # (row, message)


def _index_share(
    source: RowSource, measure: Callable[[dict[str, Any]], Any], lo: int, hi: int, stop: bool,
    columns: int,
) -> _Share:  # fmt: skip
    lengths = np.full((hi - lo, columns), -1, dtype=np.int64)
    bad: list[tuple[int, str, str, str]] = []
    for i in range(lo, hi):
        try:
            lengths[i - lo] = measure(source.row(i))
        except BadRecordError as exc:
            bad.append((i, source.where(i), exc.reason, exc.detail))
            if stop:
                break
        except Exception as exc:  # every process must stop, not only this one
            return _Share(lo, lengths, bad, (i, f"{source.where(i)}: {exc}"))
    return _Share(lo, lengths, bad, None)


def build_index(
    source: RowSource,
    measure: Callable[[dict[str, Any]], Any],
    *,
    peers: Peers | None = None,
    on_bad_record: str = "skip",
    columns: int = 1,
) -> RowIndex:
    """Measure every row of `source` (`measure(record)` → tokens, or `BadRecordError`), each
    process its share, and gather the index (module docstring). With `columns` > 1 the
    measure gives that many ints, the length first (the rest: `RowIndex.extra`). Raises
    `DataError` on every process alike: a bad record under `on_bad_record="error"`, any other
    error of a row, or no usable row at all."""
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise ValueError(f"data.on_bad_record must be one of {BAD_RECORD_POLICIES}, got "
                         f"{on_bad_record!r}")  # fmt: skip
    peers = peers or Peers()
    n = len(source)
    lo, hi = peers.share(n)
    shares: list[_Share] = sorted(
        peers.gather(_index_share(source, measure, lo, hi, on_bad_record == "error", columns)),
        key=lambda s: s.lo,
    )
    fatal = [s.fatal for s in shares if s.fatal is not None]
    if fatal:
        raise DataError(min(fatal)[1])
    bad_rows = sorted(b for s in shares for b in s.bad)
    if bad_rows and on_bad_record == "error":
        _, where, reason, detail = bad_rows[0]
        raise DataError(
            f"bad record at {where}: {reason}" + (f": {detail}" if detail else "") + ". "
            "data.on_bad_record is 'error': fix the record, or set data.on_bad_record: skip to "
            "leave bad records out (they are counted and reported at the start)"
        )
    none = np.zeros((0, columns), np.int64)
    sizes = np.concatenate([s.lengths for s in shares]) if shares else none
    report = BadRecords()
    for _, where, reason, _detail in bad_rows:
        report.add(reason, where)
    rows = np.flatnonzero(sizes[:, 0] >= 0).astype(np.int64)
    if not len(rows):
        what = report.summary() or "it is empty"
        raise DataError(f"{source.name}: no usable records ({n} rows; {what})")
    extra = sizes[rows, 1:] if columns > 1 else None
    return RowIndex(rows=rows, lengths=sizes[rows, 0], total_rows=n, bad=report, extra=extra)


class LazyItems(Generic[T]):
    """The index's items, each built from its source row when first asked for (a few kept):
    a process builds only the items of its own batches. `lengths[i]` needs no building."""

    def __init__(
        self,
        source: RowSource,
        index: RowIndex,
        build: Callable[[dict[str, Any]], T],
        size: Callable[[T], int],
        *,
        keep: int = 16,
    ) -> None:
        self.source = source
        self.index = index
        self.lengths = index.lengths
        self._build = build
        self._size = size
        self._keep = keep
        self._cache: OrderedDict[int, T] = OrderedDict()
        self.built = 0
        """How many items this process has built (tokenized) so far."""

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> T:
        i = int(i)
        item = self._cache.get(i)
        if item is not None:
            self._cache.move_to_end(i)
            return item
        row = int(self.index.rows[i])
        item = self._build(self.source.row(row))
        self.built += 1
        if self._size(item) != int(self.lengths[i]):
            raise RuntimeError(
                f"{self.source.where(row)} gives {self._size(item)} tokens now but gave "
                f"{int(self.lengths[i])} when the data was indexed: the data file or tokenizer "
                "changed during the run"
            )
        self._cache[i] = item
        if len(self._cache) > self._keep:
            self._cache.popitem(last=False)
        return item
