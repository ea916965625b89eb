"""The document structure a step-time estimate assumes: how many keys a token attends on
average in a packed row of S tokens.

By default a row is one document of S tokens under a causal mask: (S + 1) / 2 keys per token
(`flashcp.metrics.flops.causal_keys`), which at millions of tokens makes attention nearly all
of a step. Packed documents attend only within themselves: `DocumentMix` takes a sample of
document lengths (a data file's, `flashcp plan --docs`, or a seeded mix of `flashcp.data.mixes`)
and lays them end to end, in a seeded random order, into rows of S tokens — a document
crossing a row's end is cut in two pieces, as packing does with a long document — and counts
each row's visible pairs with the work model's rule (`flashcp.cp.work.document_pairs` under the
run's `attention.mask`: n(n+1)/2 per causal piece; DPO examples, whose share-question pairs are
given, are kept whole and the row padded when the next one does not fit, as
`flashcp.data.dpo_stream` packs them). The whole
sample is packed once (and, re-shuffled, again until at least `ROWS` rows are full); the rows'
mean counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.cp.work import causal_pairs, document_pairs
from flashcp.masks import DocumentMasking
from flashcp.metrics.flops import document_keys

CAUSAL = DocumentMasking()
"""The default mask: each document causal."""

ROWS = 8
"""Packed rows the estimate averages over."""
MIXES = ("long_tail", "chat")
"""The built-in mixes `--docs` names (`flashcp.data.mixes`)."""


@dataclass(frozen=True)
class DocumentMix:
    """A sample of document lengths (tokens) and, for DPO examples, their visible pairs."""

    lengths: np.ndarray
    pairs: np.ndarray | None = None
    """Visible pairs of each document (None: causal, n(n+1)/2)."""
    name: str = "documents"
    seed: int = 0
    _cache: dict[tuple[int, DocumentMasking, int], float] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths <= 0).any():
            raise ValueError(f"{self.name}: document lengths must be a non-empty list of "
                             f"positive integers, got {lengths.size} value(s)")  # fmt: skip
        object.__setattr__(self, "lengths", lengths)

    @property
    def mean_length(self) -> float:
        return float(self.lengths.mean())

    def keys_per_token(
        self, seq_len: int, masking: DocumentMasking = CAUSAL, prefix: int = 0
    ) -> float:
        """Keys a token attends on average in a packed row of `seq_len` tokens, each document
        under `masking` (module docstring)."""
        key = (int(seq_len), masking, int(prefix))
        if key not in self._cache:
            self._cache[key] = self._pairs_per_row(int(seq_len), masking, int(prefix)) / seq_len
        return self._cache[key]

    def _order(self, rng: np.random.Generator) -> np.ndarray:
        return rng.permutation(self.lengths.size)

    def _pairs_per_row(self, seq: int, masking: DocumentMasking, prefix: int) -> float:
        rng = np.random.default_rng([self.seed, 5])
        rows: list[float] = []
        pos = 0  # tokens in the current row
        row = 0.0
        passes = 0
        while len(rows) < ROWS or not passes:
            passes += 1
            for i in self._order(rng):
                n = int(self.lengths[i])
                if self.pairs is not None:  # a DPO example: whole, or the row is padded
                    n, p = min(n, seq), float(self.pairs[i]) * min(1.0, seq / n) ** 2
                    if pos + n > seq:
                        rows.append(row + float(causal_pairs(seq - pos)))
                        pos, row = 0, 0.0
                    pos, row = pos + n, row + p
                else:  # a document: cut at the row's end (the prefix in its first piece)
                    first = prefix
                    while n:
                        take = min(n, seq - pos)
                        row += float(document_pairs(masking, take, min(first, take)))
                        pos, n, first = pos + take, n - take, 0
                        if pos == seq:
                            rows.append(row)
                            pos, row = 0, 0.0
                if len(rows) >= ROWS and passes > 1:
                    break
        return float(np.mean(rows))


def keys_per_token(
    docs: DocumentMix | None, seq_len: int, masking: DocumentMasking = CAUSAL, prefix: int = 0
) -> float:
    """Keys a token attends per row of `seq_len` tokens under `masking` (the run's
    `attention.mask`; prefix_lm with `prefix`-token prefixes): one document (`docs` None), or
    packed `docs`."""
    if docs is None:
        return document_keys(masking, seq_len, prefix)
    return docs.keys_per_token(seq_len, masking, prefix)


def mix(name: str, n: int = 20000, seed: int = 0) -> DocumentMix:
    """`n` documents of a built-in mix (`MIXES`, `flashcp.data.mixes`)."""
    from flashcp.data import mixes

    if name not in MIXES:
        raise ValueError(f"unknown document mix {name!r}: use one of {', '.join(MIXES)}")
    draw = getattr(mixes, name)
    return DocumentMix(draw(n, seed=seed), name=f"{name} mix ({n} documents)", seed=seed)


def read_lengths(path: Path) -> DocumentMix:
    """Document lengths from a file: whitespace-separated integers (.txt), a JSON list of
    integers, or a `flashcp data-stats --json` report (every packed row's segments)."""
    text = path.read_text()
    if path.suffix == ".json":
        data: Any = json.loads(text)
        if isinstance(data, dict) and "steps" in data:
            data = [n for step in data["steps"] for rank in step["ranks"]
                    for micro in rank["micro_batches"] for row in micro["rows"] for n in row]
        if not isinstance(data, list) or not all(isinstance(n, int) for n in data):
            raise ValueError(f"{path}: expected a JSON list of document lengths (integers) or "
                             "a `flashcp data-stats --json` report")  # fmt: skip
        lengths = data
    else:
        try:
            lengths = [int(x) for x in text.split()]
        except ValueError as exc:
            raise ValueError(f"{path}: expected whitespace-separated document lengths "
                             f"(integers): {exc}") from None  # fmt: skip
    return DocumentMix(np.asarray(lengths, dtype=np.int64), name=str(path))


def data_documents(cfg: Any, path: str) -> DocumentMix:
    """The documents of a data sample at `path` (JSON Lines / Parquet, a file or directory, in
    `cfg`'s data format), tokenized as training would (`cfg`'s tokenizer and recipe): each
    document's length, and for DPO each example's share-question pairs."""
    import dataclasses

    from flashcp.data.dpo_stream import DPORows
    from flashcp.recipes import recipe_class

    data_cfg = dataclasses.replace(cfg.data, path=path)
    sample = recipe_class(cfg.run.recipe).data_class(dataclasses.replace(cfg, data=data_cfg),
                                                    dp_rank=0, dp_size=1)  # fmt: skip
    lengths = np.asarray(sample.index.lengths, dtype=np.int64)
    rows = getattr(sample, "plan", None)
    pairs = None
    if isinstance(rows, DPORows):  # DPO: each example's share-question pairs
        pairs = np.asarray(rows.pairs, dtype=np.float64)
    return DocumentMix(lengths, pairs, name=f"{path} ({lengths.size} documents)")


def load_documents(spec: str, cfg: Any) -> DocumentMix:
    """`flashcp plan --docs SPEC`: a built-in mix name (`MIXES`), a file of lengths (.txt /
    .json, `read_lengths`) or a data sample in the config's format (`data_documents`)."""
    if spec in MIXES:
        return mix(spec)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"{spec}: no such file or directory, and not a built-in mix "
                         f"({', '.join(MIXES)})")  # fmt: skip
    if path.is_file() and path.suffix in (".txt", ".json"):
        return read_lengths(path)
    return data_documents(cfg, spec)
