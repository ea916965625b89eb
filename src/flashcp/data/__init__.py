"""Training data: tokenizers and chat templates, JSON Lines / Parquet rows read lazily, bad
records, packing into masked sequences of full length.

    data = TrainData(cfg, dp_rank=0, dp_size=1, peers=peers)
    for batch in data.next_step():              # one Batch per micro-batch
        local = flashcp.cp.shard.shard_batch(batch, cp_rank, assignment)  # CP: this rank's part

`tokenizer` (byte / tokenizer.json / HF directory with its chat template), `chat` (assistant
turns located in the rendered conversation), `formats` (the layouts the field's tools write:
`data.format`, detection, the pre-launch check `detect` / `check_data`), `sources` (the one
reader of JSON Lines / Parquet records, rows by index), `index` (who reads which rows,
bad-record report), `dataset` (records → documents), `packing` (labels and masks, built on the
full sequence before sharding). docs/data.md has the whole picture.
"""

from flashcp.data.dataset import Document, DocumentBuilder, tokenize_records
from flashcp.data.index import BadRecords, RowIndex, build_index
from flashcp.data.loader import TrainData
from flashcp.data.packing import (
    Batch,
    PackedSequence,
    PackedStream,
    StreamState,
    collate,
    shift_labels,
)
from flashcp.data.peers import Peers
from flashcp.data.records import BadRecordError
from flashcp.data.sources import BUILTIN_CORPUS, RowSource, open_source, read_records
from flashcp.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "BUILTIN_CORPUS",
    "BadRecordError",
    "BadRecords",
    "Batch",
    "ByteTokenizer",
    "Document",
    "DocumentBuilder",
    "HFTokenizer",
    "PackedSequence",
    "PackedStream",
    "Peers",
    "RowIndex",
    "RowSource",
    "StreamState",
    "Tokenizer",
    "TrainData",
    "build_index",
    "build_tokenizer",
    "collate",
    "open_source",
    "read_records",
    "shift_labels",
    "tokenize_records",
]
