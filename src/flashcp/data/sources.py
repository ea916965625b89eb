"""Rows of a dataset, read one at a time by index: JSON Lines, Parquet, or records in memory.

`data.path` is a file, or a directory whose files with these endings (not its subdirectories)
are read in name order, all of one format:

* `.jsonl` / `.json` — JSON Lines, one object per line. Opening a file scans it once for line
  offsets (bytes only, nothing parsed; blank lines are not rows); `row(i)` seeks to line i and
  parses that line alone, so a line that is not JSON is a bad record of that row, not a crash.
  A file holding one JSON array of objects (how Alpaca and ShareGPT ship: `[{...}, {...}]`)
  is scanned once for its elements' byte offsets instead (each element parsed once, in 16 MiB
  chunks, and dropped), then read the same way, element by element.
* `.parquet` — read through the `datasets` library (`load_dataset("parquet")`), which converts
  the files once to an Arrow cache (`data.cache_dir`, default `HF_DATASETS_CACHE`) that every
  process memory-maps; `row(i)` materialises row i only.

Either way no process holds the dataset as Python objects: rows are read when a process needs
them (`flashcp.data.index` for who reads which). Row locations in messages are
`file.jsonl:LINE` (1-based line) and `file.parquet row N` (0-based, as `dataset[N]`).

This is flashcp's one reader of records: training, DPO, evaluation, the pre-launch format
check (`SampleSource`) and the shipped sets (`BUILTIN_CORPUS`, `BUILTIN_PREFERENCES`) all read
through it; `read_records` gives a whole (small) file's records as a list.
"""

from __future__ import annotations

import bisect
import codecs
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flashcp.config.schema import DATA_SUFFIXES as SUFFIXES
from flashcp.config.schema import JSONL_SUFFIXES, PARQUET_SUFFIXES
from flashcp.data.peers import Peers
from flashcp.data.records import BadRecordError

BUILTIN_CORPUS = Path(__file__).resolve().parent / "default_corpus.jsonl"
"""The small English corpus shipped inside the package (pretrain data when data.path is null)."""
BUILTIN_PREFERENCES = Path(__file__).resolve().parent / "dpo_default.jsonl"
"""The small preference set shipped inside the package (prompt / chosen / rejected strings):
DPO data when data.path is null, and the sft recipe's built-in instruction set."""

_CHUNK = 1 << 24
_WHITESPACE = np.array([9, 10, 13, 32], dtype=np.uint8)


def json_problem(exc: json.JSONDecodeError) -> str:
    """Python's JSON error for one record (a line of its file), with where in it: e.g.
    ``Unterminated string starting at column 12`` (the record's own line is named beside)."""
    where = f"column {exc.colno}" if exc.lineno == 1 else f"line {exc.lineno} column {exc.colno}"
    return f"{exc.msg} at {where}" if not exc.msg.endswith(" at") else f"{exc.msg} {where}"


class RowSource(Protocol):
    """A dataset readable row by row."""

    name: str
    """What the rows are (a path, or "built-in corpus"), for messages."""

    def __len__(self) -> int: ...

    def row(self, i: int) -> dict[str, Any]:
        """Row `i` as a dict; `BadRecordError` when it is not a record at all (not JSON, ...)."""
        ...

    def where(self, i: int) -> str:
        """Where row `i` is, for people: `file.jsonl:12`, `file.parquet row 7`."""
        ...


class ListSource:
    """Records already in memory (flashcp's small built-in sets)."""

    def __init__(self, records: Sequence[dict[str, Any]], name: str) -> None:
        self.records = list(records)
        self.name = name

    def __len__(self) -> int:
        return len(self.records)

    def row(self, i: int) -> dict[str, Any]:
        return self.records[i]

    def where(self, i: int) -> str:
        return f"{self.name} record {i + 1}"


class SampleSource:
    """At most `rows` rows of `source`, spread evenly over it (its first and last row
    included): what a preflight reads of a dataset (`flashcp.preflight`), through the
    same data classes training uses. Each row is read once, here: the format check
    (`flashcp.data.formats.check_data`) and the indexing that follow read these copies."""

    def __init__(self, source: RowSource, rows: int) -> None:
        total = len(source)
        picks = np.linspace(0, total - 1, num=min(rows, total)) if total else np.zeros(0)
        self.rows = np.unique(np.round(picks).astype(np.int64))
        self.source = source
        self.total = total
        self.name = source.name if len(self.rows) == total else (
            f"{source.name} (a sample of {len(self.rows)} of its {total} rows)"
        )  # fmt: skip
        self._read: list[dict[str, Any] | BadRecordError] = []
        for i in self.rows:
            try:
                self._read.append(source.row(int(i)))
            except BadRecordError as exc:
                self._read.append(exc)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def row(self, i: int) -> dict[str, Any]:
        got = self._read[i]
        if isinstance(got, BadRecordError):
            raise BadRecordError(got.reason, got.detail)
        return dict(got)

    def records(self) -> list[dict[str, Any]]:
        """The rows that are records (a bad one, not JSON say, left out)."""
        return [dict(r) for r in self._read if not isinstance(r, BadRecordError)]

    def where(self, i: int) -> str:
        return self.source.where(int(self.rows[i]))


def scan_lines(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets `[start, end)` and 1-based line numbers of the non-blank lines of `path`,
    read in 16 MiB chunks (whitespace-only lines are blank; `\\r\\n` endings are fine)."""
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    numbers: list[np.ndarray] = []
    base = 0  # file offset of buf[0]
    lines_before = 0  # lines (blank or not) before buf
    carry = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            final = not chunk
            buf = carry + chunk
            arr = np.frombuffer(buf, dtype=np.uint8)
            nl = np.flatnonzero(arr == 10)
            s = np.concatenate([[0], nl + 1])
            e = np.concatenate([nl, [len(buf)]])
            cut = 0
            if not final:  # the last piece may continue in the next chunk
                cut = int(s[-1])
                carry = buf[cut:]
                s, e = s[:-1], e[:-1]
            content = np.concatenate([[0], np.cumsum(~np.isin(arr, _WHITESPACE))])
            keep = content[e] > content[s]
            starts.append(s[keep] + base)
            ends.append(e[keep] + base)
            numbers.append(np.flatnonzero(keep) + lines_before + 1)
            if final:
                break
            lines_before += len(s)
            base += cut
    return (
        np.concatenate(starts).astype(np.int64),
        np.concatenate(ends).astype(np.int64),
        np.concatenate(numbers).astype(np.int64),
    )


class JsonlSource:
    """JSON Lines files (or files of one JSON array) as one sequence of rows: the non-blank
    lines (the array's elements), file by file."""

    def __init__(self, paths: Sequence[Path], name: str) -> None:
        self._handles: dict[int, Any] = {}
        self.paths = [Path(p) for p in paths]
        self.name = name
        self._spans = []
        self._first: list[int] = []  # global index of each file's first row
        total = 0
        for p in self.paths:
            spans = scan_json_array(p) if _starts_array(p) else scan_lines(p)
            self._spans.append(spans)
            self._first.append(total)
            total += len(spans[0])
        self._len = total

    def __len__(self) -> int:
        return self._len

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} of {self._len}")
        f = bisect.bisect_right(self._first, i) - 1
        return f, i - self._first[f]

    def where(self, i: int) -> str:
        f, j = self._locate(i)
        return f"{self.paths[f]}:{int(self._spans[f][2][j])}"

    def row(self, i: int) -> dict[str, Any]:
        f, j = self._locate(i)
        start, end = int(self._spans[f][0][j]), int(self._spans[f][1][j])
        handle = self._handles.get(f)
        if handle is None:
            handle = self._handles[f] = open(self.paths[f], "rb")  # noqa: SIM115 (kept open)
        handle.seek(start)
        raw = handle.read(end - start)
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BadRecordError("not UTF-8 text", str(exc)) from None
        except json.JSONDecodeError as exc:
            raise BadRecordError("not valid JSON", json_problem(exc)) from None
        if not isinstance(record, dict):
            raise BadRecordError("not a JSON object", f"got {type(record).__name__}")
        return record

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __del__(self) -> None:
        self.close()


def _starts_array(path: Path) -> bool:
    """The file's first non-whitespace byte is `[`: one JSON array, not JSON Lines."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            head = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
            if head:
                return head.startswith(b"[")
    return False


def iter_json_array(path: Path) -> Iterator[tuple[int, int, int, Any]]:
    """`(start, end, line, element)` of each element of the JSON array that fills `path`:
    byte offsets `[start, end)`, the 1-based line it starts on, the parsed value. Read in
    16 MiB chunks, each element parsed once; `ValueError` naming the line when the file is
    not one valid JSON array."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        buf, base, line, eof = "", 0, 1, False  # buf[0] is at byte `base`, on line `line`

        def more() -> bool:
            nonlocal buf, eof
            if eof:
                return False
            chunk = f.read(_CHUNK)
            eof = not chunk
            buf += utf8.decode(chunk, final=eof)
            return True

        def advance(i: int) -> None:  # drop buf[:i], keeping the offsets
            nonlocal buf, base, line
            base += len(buf[:i].encode("utf-8"))
            line += buf.count("\n", 0, i)
            buf = buf[i:]

        def next_char() -> str:  # skip whitespace; "" at the end of the file
            while True:
                stripped = buf.lstrip(" \t\r\n\ufeff")  # a BOM may lead the file
                if stripped or not more():
                    advance(len(buf) - len(stripped))
                    return buf[:1]

        def fail(what: str) -> ValueError:
            return ValueError(f"data.path: {path} starts a JSON array but is not valid JSON at "
                              f"line {line}: {what}")  # fmt: skip

        if next_char() != "[":
            raise fail("expected '['")
        advance(1)
        if next_char() == "]":
            advance(1)
        else:
            while True:
                next_char()
                while True:  # parse one element, reading on while it is cut by the chunk end
                    try:
                        value, end = decoder.raw_decode(buf)
                    except json.JSONDecodeError as exc:
                        if more():
                            continue
                        raise fail(exc.msg) from None
                    if end < len(buf) or not more():  # a number could go on in the next chunk
                        break
                start = base
                width = len(buf[:end].encode("utf-8"))
                yield start, start + width, line, value
                advance(end)
                sep = next_char()
                advance(1)
                if sep == "]":
                    break
                if sep != ",":
                    raise fail(f"expected ',' or ']' after an element, got {sep or 'the end'!r}")
        if next_char():
            raise fail("more data after the array's closing ']'")


def scan_json_array(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets `[start, end)` and 1-based start lines of the elements of the JSON array
    that fills `path` (the values are parsed once and dropped)."""
    starts, ends, lines = [], [], []
    for start, end, line, _ in iter_json_array(path):
        starts.append(start)
        ends.append(end)
        lines.append(line)
    return (np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64),
            np.asarray(lines, dtype=np.int64))  # fmt: skip



class ParquetSource:
    """Parquet files through `datasets` (a memory-mapped Arrow cache), row by row."""

    def __init__(self, paths: Sequence[Path], name: str, cache_dir: str | None = None) -> None:
        import datasets
        import pyarrow.parquet as pq

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        self.paths = [Path(p) for p in paths]
        self.name = name
        self._ds = datasets.load_dataset(
            "parquet",
            data_files=[str(p) for p in self.paths],
            split="train",
            cache_dir=cache_dir,
        )
        self._first: list[int] = []
        total = 0
        for p in self.paths:
            self._first.append(total)
            total += int(pq.ParquetFile(p).metadata.num_rows)
        if total != len(self._ds):
            raise ValueError(f"{name}: the Parquet files hold {total} rows, datasets read "
                             f"{len(self._ds)}")  # fmt: skip

    def __len__(self) -> int:
        return len(self._ds)

    def where(self, i: int) -> str:
        f = bisect.bisect_right(self._first, i) - 1
        return f"{self.paths[f]} row {i - self._first[f]}"

    def row(self, i: int) -> dict[str, Any]:
        return dict(self._ds[int(i)])


def data_files(path: str | Path) -> list[Path]:
    """The files of `data.path`: the file itself, or the data files directly in a directory
    (sorted by name; subdirectories are not searched); `ValueError` naming the problem
    otherwise."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise ValueError(
                f"data.path: {p} is not a JSON Lines ({', '.join(JSONL_SUFFIXES)}) or Parquet "
                "(.parquet) file: give one of those (or a directory of them)"
            )
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"data.path: no file or directory at {p}")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in SUFFIXES)
    if not files:
        raise ValueError(
            f"data.path: the directory {p} holds no .jsonl, .json or .parquet files: give a "
            "data file or a directory of them"
        )
    kinds = {f.suffix.lower() in PARQUET_SUFFIXES for f in files}
    if len(kinds) > 1:
        raise ValueError(
            f"data.path: the directory {p} mixes JSON Lines and Parquet files: keep one format "
            "per directory"
        )
    return files


def open_source(
    path: str | Path, *, cache_dir: str | None = None, peers: Peers | None = None
) -> RowSource:
    """The rows of `data.path`. With several processes, Parquet's Arrow cache is built by
    rank 0 first and then opened by the others (an error on rank 0 stops them all)."""
    files = data_files(path)
    name = str(path)
    if files[0].suffix.lower() in JSONL_SUFFIXES:
        return JsonlSource(files, name)
    peers = peers or Peers()
    failure = None
    source = None
    if peers.rank == 0:
        try:
            source = ParquetSource(files, name, cache_dir)
        except Exception as exc:  # every rank must hear of it, not wait for rank 0
            failure = f"{type(exc).__name__}: {exc}"
    first = peers.gather(failure)[0]
    if first is not None:
        raise ValueError(f"data.path {path}: could not read the Parquet data: {first}")
    return source if source is not None else ParquetSource(files, name, cache_dir)


def read_records(path: str | Path, *, name: str | None = None) -> list[dict[str, Any]]:
    """Every record of `path` (a data file or directory, as `data.path`), in memory: for small
    sets (the shipped ones, a test's file). A row that is not a record is a `ValueError`
    naming its file and line (`file.jsonl:12: not valid JSON: Expecting ',' delimiter at
    column 14`)."""
    files = data_files(path)
    label = name or str(path)
    source = (JsonlSource(files, label) if files[0].suffix.lower() in JSONL_SUFFIXES
              else ParquetSource(files, label))  # fmt: skip
    out = []
    for i in range(len(source)):
        try:
            out.append(source.row(i))
        except BadRecordError as exc:
            raise ValueError(f"{source.where(i)}: {exc}") from None
    if isinstance(source, JsonlSource):
        source.close()
    return out
