"""Data pipeline cost: indexing throughput and the memory a process holds, lazy vs eager.

Data: `--rows` generated conversations (`messages`, one or two turns, from the shipped
preference set) in a JSON Lines file, tokenized with a generated GLM-4-style tokenizer
directory (`bench.hfdir`: byte-level BPE, GLM's special tokens and chat template).

* held memory (tracemalloc, bytes still allocated after construction, the tokenizer built
  before tracing starts): `lazy` = `flashcp.data.TrainData` (an index of one int64 length per
  row; rows read and tokenized when a batch needs them) vs `eager` = every row parsed and
  tokenized into a list of `Document`s, as every process did before rows were read lazily;
* indexing time (no tracing): building the `TrainData` (scan + read + render + tokenize every
  row once) for sft on `messages`, and for pretrain on the same rows' text.

Interleaved: the variants alternate within each of `--repeats` rounds (lazy, eager, then eager,
lazy, ...). Reported: medians and min-max over the rounds, and the ratio eager / lazy of held
bytes. Prints JSON (and writes it to `--json` if given).

Usage:
    python scripts/bench_data.py                      # 4000 rows, 3 rounds
    python scripts/bench_data.py --rows 500 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench import stats
from bench.hfdir import DEFAULT_VOCAB, chat_records, write_jsonl, write_tokenizer_files
from bench.rounds import interleave
from flashcp.config import build_config
from flashcp.data import HFTokenizer, TrainData
from flashcp.data.dataset import DocumentBuilder
from flashcp.data.sources import open_source


def _cfg(tok: Path, path: Path, recipe: str) -> Any:
    return build_config(
        {
            "model": {"preset": "tiny_glm", "vocab_size": DEFAULT_VOCAB},
            "data": {"tokenizer": str(tok), "path": str(path), "seq_len": 256,
                     "text_field": "text"},  # fmt: skip
            "run": {"recipe": recipe},
        }
    )


def _eager(cfg: Any, tokenizer: HFTokenizer) -> list[Any]:
    """Every row parsed and tokenized, held as Documents (one process's copy)."""
    source = open_source(cfg.data.path)
    build = DocumentBuilder(tokenizer, recipe=cfg.run.recipe)
    return [build(source.row(i)) for i in range(len(source))]


def _held(fn: Any) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = fn()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, obj


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="flashcp-bench-data-"))
    tok_dir = write_tokenizer_files(work / "tok")
    records = chat_records(args.rows)
    for r in records:  # the same conversations as plain text, for pretrain
        r["text"] = "\n".join(m["content"] for m in r["messages"])
    path = write_jsonl(work / "chat.jsonl", records)
    tokenizer = HFTokenizer(tok_dir)
    sft, pretrain = _cfg(tok_dir, path, "sft"), _cfg(tok_dir, path, "pretrain")
    held: dict[str, list[float]] = {"lazy": [], "eager": []}
    index_s: dict[str, list[float]] = {"sft_messages": [], "pretrain_text": []}
    tokens = 0
    held_rounds = interleave(["lazy", "eager"], args.repeats)
    index_rounds = interleave(list(index_s), args.repeats)
    for held_round, index_round in zip(held_rounds, index_rounds, strict=True):  # both rotate
        for name in held_round.order:
            if name == "lazy":
                n, data = _held(lambda: TrainData(sft, tokenizer=tokenizer))
                tokens = data.num_tokens
            else:
                n, docs = _held(lambda: _eager(sft, tokenizer))
                assert sum(len(d) for d in docs) == tokens or not tokens
            held[name].append(float(n))
        for key in index_round.order:
            cfg = sft if key == "sft_messages" else pretrain
            index_s[key].append(_timed(lambda c=cfg: TrainData(c, tokenizer=tokenizer)))
    out = {
        "rows": args.rows,
        "tokens": tokens,
        "repeats": args.repeats,
        "held_bytes": {k: stats.spread(v) for k, v in held.items()},
        "held_ratio_eager_over_lazy": stats.spread(
            [e / lz for e, lz in zip(held["eager"], held["lazy"], strict=True)]
        ),
        "index_seconds": {k: stats.spread(v) for k, v in index_s.items()},
        "index_rows_per_s": {
            k: stats.spread([args.rows / s for s in v]) for k, v in index_s.items()
        },
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
