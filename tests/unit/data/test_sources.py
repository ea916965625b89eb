"""Data files: JSON Lines and Parquet rows read lazily, indexed by all ranks together, bad
records counted (skip) or refused (error), each dp rank reading only its own rows, and the data
position resuming bitwise. Ranks are simulated by threads sharing a real all-gather."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.hfdir import (
    chat_records,
    preference_records,
    write_jsonl,
    write_parquet,
    write_tokenizer_files,
)
from flashcp.config import Config
from flashcp.data import Document, HFTokenizer, PackedStream, TrainData
from flashcp.data.balance import BalancedPlan
from flashcp.data.dpo_stream import DPOData
from flashcp.data.index import LazyItems, build_index
from flashcp.data.peers import Peers
from flashcp.data.records import BadRecordError
from flashcp.data.sources import JsonlSource, ListSource, data_files, open_source
from helpers.configs import TINY_GLM, merged, tiny_config

VOCAB = 384


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


SOURCES = merged(
    TINY_GLM, model={"vocab_size": VOCAB}, data={"seq_len": 64}, train={"seed": 3}
)
"""The tiny GLM reading 64-token rows through the test tokenizer."""


def _data_cfg(tmp: Path, tok_dir: Path, path: Path | None, **data: Any) -> Config:
    """`SOURCES` reading `path` (`data` keys over its data section; `recipe` the recipe,
    default sft), its cache under `tmp`."""
    recipe = data.pop("recipe", "sft")
    files = {"tokenizer": str(tok_dir), "path": None if path is None else str(path),
             "cache_dir": str(tmp / "cache")}  # fmt: skip
    return tiny_config(tmp, base=SOURCES, data={**files, **data}, run={"recipe": recipe})


def run_ranks(n: int, fn: Callable[[Peers], Any]) -> list[Any]:
    """`fn(peers)` on `n` threads acting as ranks; their `gather` is a real all-gather."""
    barrier = threading.Barrier(n, timeout=120)
    slots: list[Any] = [None] * n
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def gather_for(rank: int) -> Callable[[Any], list[Any]]:
        def gather(obj: Any) -> list[Any]:
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        return gather

    def body(rank: int) -> None:
        try:
            results[rank] = fn(Peers(rank, n, gather_for(rank)))
        except BaseException as exc:
            errors[rank] = exc
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for exc in errors:
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
            raise exc
    return results


# -- formats ----------------------------------------------------------------------------------


def _ids(data: Any, steps: int) -> list[np.ndarray]:
    return [b.input_ids for _ in range(steps) for b in data.next_step()]


def test_jsonl_parquet_and_directories_give_the_same_batches(tmp_path: Path, tok_dir: Path):
    records = chat_records(30)
    jsonl = write_jsonl(tmp_path / "chat.jsonl", records)
    parquet = write_parquet(tmp_path / "chat.parquet", records)
    parts = tmp_path / "parts"
    write_jsonl(parts / "a.jsonl", records[:11])
    write_jsonl(parts / "b.jsonl", records[11:])
    shards = tmp_path / "shards"
    write_parquet(shards / "train-00000-of-00002.parquet", records[:17])
    write_parquet(shards / "train-00001-of-00002.parquet", records[17:])
    runs = {
        p.name: TrainData(_data_cfg(tmp_path, tok_dir, p)) for p in (jsonl, parquet, parts, shards)
    }
    want = _ids(TrainData(_data_cfg(tmp_path, tok_dir, jsonl)), 8)
    for name, data in runs.items():
        assert data.num_documents == 30 and data.bad_records.total == 0, name
        got = _ids(data, 8)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), name
    assert runs["shards"].source.where(20) == f"{shards}/train-00001-of-00002.parquet row 3"
    assert runs["parts"].source.where(12) == f"{parts}/b.jsonl:2"
    assert list((tmp_path / "cache").iterdir())  # the Arrow cache went to data.cache_dir


def test_json_array_files_are_read_element_by_element(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `.json` holding one JSON array (Alpaca's and ShareGPT's files: `json.dump(rows,
    indent=4)`) gives the rows the same records as JSON Lines do, with elements cut by the
    16 MiB read chunks (here 5 bytes), multi-byte text and a byte-order mark; rows that are not
    objects are bad records, a broken array is refused naming the line."""
    import json

    from flashcp.data import sources

    records = chat_records(30)
    records[3] = dict(records[3], note="naïve café ✓")
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    arr = tmp_path / "d.json"
    arr.write_text("\ufeff" + json.dumps(records, indent=4, ensure_ascii=False), encoding="utf-8")
    want = _ids(TrainData(_data_cfg(tmp_path, tok_dir, jsonl)), 8)
    monkeypatch.setattr(sources, "_CHUNK", 5)
    source = open_source(arr)
    assert [source.row(i) for i in range(len(source))] == records
    lines = [i + 2 for i, line in enumerate(arr.read_text("utf-8").splitlines()[1:])
             if line == "    {"]  # fmt: skip
    assert [source.where(i) for i in range(3)] == [f"{arr}:{n}" for n in lines[:3]]
    data = TrainData(_data_cfg(tmp_path, tok_dir, arr))
    got = _ids(data, 8)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    (tmp_path / "mixed.json").write_text('[{"text": "a"}, 7, [1], {"text": "b"}]')
    mixed = open_source(tmp_path / "mixed.json")
    assert len(mixed) == 4 and mixed.row(3) == {"text": "b"}
    for i in (1, 2):
        with pytest.raises(BadRecordError, match="not a JSON object"):
            mixed.row(i)
    for text, what in [
        ('[{"text": "a"},\n {"text": "b"}', "line 2: expected ',' or ']'"),
        ('[{"text": "a"},\n {"text": }]', "line 2: Expecting value"),
        ('[{"text": "a"}] {"text": "b"}', "line 1: more data after the array's closing"),
    ]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=f"bad.json starts a JSON array but is not valid "
                                             f"JSON at {what}"):  # fmt: skip
            open_source(tmp_path / "bad.json")
    (tmp_path / "none.json").write_text(" [ ] ")
    assert len(open_source(tmp_path / "none.json")) == 0


def test_source_errors(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "a.jsonl", [{"text": "a"}])
    write_parquet(mixed / "b.parquet", [{"text": "b"}])
    with pytest.raises(ValueError, match="mixes JSON Lines and Parquet"):
        data_files(mixed)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .jsonl, .json or .parquet files"):
        data_files(tmp_path / "empty")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="is not a JSON Lines .* or Parquet"):
        data_files(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="no file or directory"):
        data_files(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n \n")
    empty = open_source(tmp_path / "empty.jsonl")
    assert len(empty) == 0
    with pytest.raises(ValueError, match="empty.jsonl: no usable records .*it is empty"):
        build_index(empty, len)
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n{"text": "ok"}\n')
    latin = open_source(tmp_path / "latin.jsonl")
    with pytest.raises(Exception, match="not UTF-8 text") as info:
        latin.row(0)
    assert info.type.__name__ == "BadRecordError" and latin.row(1) == {"text": "ok"}
    with pytest.raises(IndexError, match="row 2 of 2"):
        latin.row(2)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="could not read the Parquet data"):
        open_source(tmp_path / "bad.parquet", cache_dir=str(tmp_path / "c"))
    # every rank hears of rank 0's failure (no rank waits forever for it)
    errors = run_ranks(2, lambda peers: _raises(lambda: open_source(
        tmp_path / "bad.parquet", cache_dir=str(tmp_path / "c"), peers=peers)))  # fmt: skip
    assert all("could not read the Parquet data" in e for e in errors)


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return str(exc)
    raise AssertionError("no error")


# -- bad records ------------------------------------------------------------------------------

GOOD = chat_records(12)
BAD_ROWS: list[tuple[Any, str]] = [
    ({"text": "no messages"}, "missing field 'messages'"),
    ({"messages": "hello"}, "field 'messages' is not a list of messages"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]},
     "empty answer"),  # fmt: skip
    ({"messages": [{"role": "user", "content": "Q"}]},
     "conversation does not end with an assistant turn"),  # fmt: skip
    ({"messages": [{"role": "user", "content": "word " * 80},
                   {"role": "assistant", "content": "A"}]}, "too long"),  # fmt: skip
]


def _bad_jsonl(path: Path) -> Path:
    """GOOD with the BAD_ROWS, a line that is not JSON, a JSON list and blank lines mixed in."""
    lines = [GOOD[0], GOOD[1], BAD_ROWS[0][0], GOOD[2], BAD_ROWS[1][0], GOOD[3], BAD_ROWS[2][0],
             GOOD[4], BAD_ROWS[3][0], GOOD[5], BAD_ROWS[4][0], *GOOD[6:]]  # fmt: skip
    import json

    text = "\n".join(json.dumps(r) for r in lines[:4]) + "\n\n{oops\n[1, 2]\n  \n"
    text += "\n".join(json.dumps(r) for r in lines[4:]) + "\n"
    path.write_text(text)
    return path


def test_bad_records_are_counted_and_reported(tmp_path: Path, tok_dir: Path) -> None:
    path = _bad_jsonl(tmp_path / "d.jsonl")
    cfg = _data_cfg(tmp_path, tok_dir, path, packing=False, seq_len=64)
    data = TrainData(cfg)
    bad = data.bad_records
    assert data.num_documents == len(GOOD) and data.index.total_rows == len(GOOD) + 7
    assert bad.counts == {
        "missing field 'messages'": 1,
        "field 'messages' is not a list of messages": 1,
        "empty answer": 1,
        "conversation does not end with an assistant turn": 1,
        "too long": 1,
        "not valid JSON": 1,
        "not a JSON object": 1,
    }
    # row locations are file lines (blank lines count as lines, are not rows)
    assert bad.first["missing field 'messages'"] == [f"{path}:3"]
    assert bad.first["not valid JSON"] == [f"{path}:6"]
    assert bad.first["not a JSON object"] == [f"{path}:7"]
    assert bad.first["too long"] == [f"{path}:15"]
    from flashcp.recipes.lm import LMData

    line = LMData(cfg).describe()
    assert f"({bad.total} bad records skipped: " in line and f"too long ×1 ({path}:15)" in line
    report = data.data_report()
    assert report["rows"] == 19 and report["documents"] == 12
    assert report["bad_records"]["skipped"] == 7
    assert report["bad_records"]["reasons"]["empty answer"] == {"count": 1,
                                                               "first": [f"{path}:11"]}  # fmt: skip
    # policy error: stops before any batch, naming the first bad row and its reason
    strict = _data_cfg(tmp_path, tok_dir, path, packing=False, seq_len=64, on_bad_record="error")
    with pytest.raises(ValueError, match=rf"bad record at {path}:3: missing field 'messages': an "
                       r"sft record needs .* its keys: text\. data\.on_bad_record is 'error': fix "
                       r"the record, or set data\.on_bad_record: skip"):  # fmt: skip
        TrainData(strict)
    # the same from Parquet: null fields, row numbers of the Parquet file
    rows = [*GOOD[:3], {"messages": None}, *GOOD[3:], BAD_ROWS[2][0]]
    pq = write_parquet(tmp_path / "d.parquet", rows)
    pdata = TrainData(_data_cfg(tmp_path, tok_dir, pq))
    assert pdata.num_documents == 12
    assert pdata.bad_records.first == {"missing field 'messages'": [f"{pq} row 3"],
                                       "empty answer": [f"{pq} row 13"]}  # fmt: skip
    with pytest.raises(ValueError, match=rf"bad record at {pq} row 3: missing field"):
        TrainData(_data_cfg(tmp_path, tok_dir, pq, on_bad_record="error"))


def test_index_errors_and_reports(tmp_path: Path) -> None:
    source = ListSource([{"n": i} for i in range(12)], "numbers")

    def measure(r: dict[str, Any]) -> int:
        from flashcp.data.records import BadRecordError

        if r["n"] % 2:
            raise BadRecordError("odd", f"n = {r['n']}")
        return r["n"] + 1

    index = build_index(source, measure)
    assert index.rows.tolist() == [0, 2, 4, 6, 8, 10]
    assert index.lengths.tolist() == [1, 3, 5, 7, 9, 11]
    assert index.bad.counts == {"odd": 6}
    assert index.bad.first["odd"] == [f"numbers record {i}" for i in (2, 4, 6, 8, 10)]
    assert index.bad.summary() == ("6 bad records skipped: odd ×6 (numbers record 2, numbers "
                                   "record 4, numbers record 6, numbers record 8, numbers "
                                   "record 10, ...)")  # fmt: skip
    with pytest.raises(ValueError, match="numbers: no usable records .*odd ×1"):
        build_index(ListSource([{"n": 1}], "numbers"), measure)
    with pytest.raises(ValueError, match="no usable records .*it is empty"):
        build_index(ListSource([], "numbers"), measure)
    with pytest.raises(ValueError, match="on_bad_record must be one of"):
        build_index(source, measure, on_bad_record="ignore")
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        Peers(2, 2)
    # an item rebuilt with another length than indexed: the data changed under the run
    records = [{"n": 0}, {"n": 2}]
    changing = ListSource(records, "numbers")
    items = LazyItems(changing, build_index(changing, measure), measure, lambda n: n)
    assert items[1] == 3 and items[1] == 3 and items.built == 1  # cached
    records[0]["n"] = 4
    with pytest.raises(RuntimeError, match="numbers record 1 gives 5 tokens now but gave 1"):
        items[0]

    def crash(r: dict[str, Any]) -> int:
        if r["n"] == 7:
            raise KeyError("boom")
        return 1

    # any other error stops every rank alike, naming the row where it showed
    msgs = run_ranks(3, lambda peers: _raises(lambda: build_index(source, crash, peers=peers)))
    assert msgs == ["numbers record 8: 'boom'"] * 3


# -- lazy, per-rank reading -------------------------------------------------------------------


class _Reads:
    """Which rows each thread (rank) reads from JsonlSource, during and after indexing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[str, list[int]] = {}
        original = JsonlSource.row

        def row(source: JsonlSource, i: int) -> dict[str, Any]:
            self.rows.setdefault(threading.current_thread().name, []).append(int(i))
            return original(source, i)

        monkeypatch.setattr(JsonlSource, "row", row)

    def take(self) -> dict[str, list[int]]:
        out, self.rows = self.rows, {}
        return out


def test_each_rank_reads_only_its_rows(tmp_path: Path, tok_dir: Path, monkeypatch) -> None:
    n = 40
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(n))
    reads = _Reads(monkeypatch)
    cfg = _data_cfg(tmp_path, tok_dir, path, packing=False, micro_batch_size=2)
    datas = run_ranks(2, lambda peers: TrainData(cfg, dp_rank=peers.rank, dp_size=2,
                                                 peers=peers))  # fmt: skip
    # indexing: rank k read its contiguous share [n·k/2, n·(k+1)/2) once, nothing else
    assert reads.take() == {"rank0": list(range(20)), "rank1": list(range(20, 40))}
    assert all(np.array_equal(d.index.lengths, datas[0].index.lengths) for d in datas)
    # training: over one epoch (10 steps × 2 ranks × 2 sequences) the ranks read disjoint rows
    # that together are every row once; each reads only its own batches' rows
    steps = [run_ranks(2, lambda peers: datas[peers.rank].next_step()) for _ in range(10)]
    got = reads.take()
    assert len(got["rank0"]) == len(got["rank1"]) == 20
    assert not set(got["rank0"]) & set(got["rank1"])
    assert sorted(got["rank0"] + got["rank1"]) == list(range(n))
    # the same sequences as one rank with the whole micro-batch (layout-invariant), in order
    one = TrainData(_data_cfg(tmp_path, tok_dir, path, packing=False, micro_batch_size=4))
    reads.take()
    for parts in steps:
        (whole,) = one.next_step()
        np.testing.assert_array_equal(
            np.concatenate([parts[0][0].input_ids, parts[1][0].input_ids]), whole.input_ids
        )
    assert datas[0].state_dict() == datas[1].state_dict() == one.state_dict()


@pytest.mark.parametrize("balance", ["none", "work"])
def test_packed_ranks_read_only_documents_of_their_sequences(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch, balance: str
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    reads = _Reads(monkeypatch)
    cfg = _data_cfg(tmp_path, tok_dir, path, seq_len=256, balance=balance)
    datas = run_ranks(2, lambda peers: TrainData(cfg, dp_rank=peers.rank, dp_size=2,
                                                 peers=peers))  # fmt: skip
    reads.take()
    for _ in range(4):
        run_ranks(2, lambda peers: datas[peers.rank].next_step())
    got = reads.take()
    # which documents each rank's sequences hold: the same plan over stand-in documents whose
    # every token is the document's number (sequence j of each step is rank j's)
    index = datas[0].index
    stand_ins = [Document(np.full(n, i), np.ones(n, dtype=bool)) for i, n in
                 enumerate(index.lengths)]  # fmt: skip
    stream = PackedStream(stand_ins, 256, seed=3)
    plan = BalancedPlan(stream, 2, 16) if balance == "work" else None
    held: list[set[int]] = [set(), set()]
    for _ in range(4):
        rows = plan.next_step() if plan is not None else [stream.plan_next() for _ in range(2)]
        for rank in range(2):
            held[rank] |= {int(t) for t in stream.build(rows[rank]).tokens}
    for rank in range(2):
        assert set(got[f"rank{rank}"]) == {int(index.rows[i]) for i in held[rank]}
    assert held[0] != held[1] and len(held[0] | held[1]) < len(index)  # not every row


def test_resume_is_bitwise_with_messages_data(tmp_path: Path, tok_dir: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(10))
    cfg = _data_cfg(tmp_path, tok_dir, path, seq_len=48, micro_batch_size=1)

    def ranks() -> list[TrainData]:
        return run_ranks(2, lambda p: TrainData(cfg, dp_rank=p.rank, dp_size=2, peers=p))

    first = ranks()
    for _ in range(10):  # past an epoch of 10 short conversations
        for d in first:
            d.next_step()
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["stream"]["epoch"] >= 1
    want = [[b for _ in range(5) for b in d.next_step()] for d in first]
    again = ranks()
    for d in again:
        d.load_state_dict(state)
    got = [[b for _ in range(5) for b in d.next_step()] for d in again]
    for r in range(2):
        for a, b in zip(got[r], want[r], strict=True):
            for name in ("input_ids", "labels", "positions"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            np.testing.assert_array_equal(a.mask.indices, b.mask.indices)


# -- DPO data ---------------------------------------------------------------------------------


def test_dpo_data_from_message_files_per_rank(tmp_path: Path, tok_dir: Path, monkeypatch):
    records = preference_records(30, as_messages=True)
    records[4] = dict(records[4], chosen=[])  # a bad record: counted, skipped
    jsonl = write_jsonl(tmp_path / "pref.jsonl", records)
    parquet = write_parquet(tmp_path / "pref.parquet", records)
    extra = {"recipe": "dpo", "seq_len": 128}
    reads = _Reads(monkeypatch)
    cfg = _data_cfg(tmp_path, tok_dir, jsonl, **extra)
    datas = run_ranks(2, lambda p: DPOData(cfg, dp_rank=p.rank, dp_size=2, peers=p))
    assert reads.take() == {"rank0": list(range(15)), "rank1": list(range(15, 30))}
    assert datas[0].num_examples == 29
    assert datas[0].bad_records.first == {"field 'chosen' is not a list of messages":
                                          [f"{jsonl}:5"]}  # fmt: skip
    assert "29 preference pairs" in datas[0].describe() and "1 bad record skipped" in (
        datas[0].describe()
    )
    steps = [run_ranks(2, lambda p: datas[p.rank].next_step()) for _ in range(4)]
    got = reads.take()
    ids = [
        set(int(i) for step in steps for b in step[r] for i in b.example_ids) for r in range(2)
    ]
    assert not ids[0] & ids[1]  # disjoint packed rows, disjoint examples
    assert len(got["rank0"]) == len(ids[0]) and len(got["rank1"]) == len(ids[1])
    one = DPOData(_data_cfg(tmp_path, tok_dir, parquet, micro_batch_size=2, **extra))
    assert one.num_examples == 29
    for step in steps:
        (whole,) = one.next_step()
        np.testing.assert_array_equal(
            np.concatenate([step[0][0].input_ids, step[1][0].input_ids]), whole.input_ids
        )
    assert one.state_dict() == datas[0].state_dict()
    tok = HFTokenizer(tok_dir)
    (first,) = one.next_step()
    assert tok.decode(first.input_ids[0].tolist()).count("\n") >= 2  # rendered turns


def test_a_record_that_is_not_json_is_reported_with_where_in_it(
    tmp_path: Path, tok_dir: Path
) -> None:
    """Python's JSON message keeps its position (issue 37: it was cut to 'Unterminated string
    starting at.'): the record's file line, and the column in it."""
    import json

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD[0]) + '\n{"messages": "unterminated\n')
    strict = _data_cfg(tmp_path, tok_dir, path, packing=False, seq_len=64, on_bad_record="error")
    with pytest.raises(ValueError, match=rf"bad record at {path}:2: not valid JSON: "
                       r"Unterminated string starting at column 14\b"):  # fmt: skip
        TrainData(strict)
