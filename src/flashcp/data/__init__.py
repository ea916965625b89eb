"""Training data: tokenizers, JSONL documents, packing into masked sequences, CP sharding.

    data = TrainData(cfg, dp_rank=0, dp_size=1)
    for batch in data.next_step():              # one Batch per micro-batch
        local = shard_batch(batch, cp_rank, assignment)

See `packing` for how labels and masks are built (on the full sequence, before sharding).
"""

from flashcp.data.dataset import (
    DEFAULT_CORPUS,
    Document,
    default_corpus_text,
    parse_jsonl,
    read_records,
    tokenize_records,
)
from flashcp.data.loader import TrainData
from flashcp.data.packing import (
    Batch,
    LocalBatch,
    PackedSequence,
    PackedStream,
    StreamState,
    collate,
    shard_batch,
    shift_labels,
)
from flashcp.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "DEFAULT_CORPUS",
    "Batch",
    "ByteTokenizer",
    "Document",
    "HFTokenizer",
    "LocalBatch",
    "PackedSequence",
    "PackedStream",
    "StreamState",
    "Tokenizer",
    "TrainData",
    "build_tokenizer",
    "collate",
    "default_corpus_text",
    "parse_jsonl",
    "read_records",
    "shard_batch",
    "shift_labels",
    "tokenize_records",
]
