"""FlashMask masks as a record and their builders: `Mask` (int32 `startend_row_indices` and
the `causal` flag they go with), one builder per mask family of the FlashMask docs (each
returns a validated `Mask`), and `DocumentMasking` (the mask a run's config gives each packed
document: `attention.mask`).

What the indices mean — the column layouts, the dense oracle, tile classes, the non-causal
rewrite and the checks — is `flashcp.mask_indices`; `Mask.dense` and `Mask.noncausal` call it.
The seeded generators of every family, for tests and benchmarks, are `flashcp.mask_families`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashcp.mask_indices import to_dense, to_noncausal, validate


@dataclass(frozen=True, eq=False)
class Mask:
    """A FlashMask mask: int32 `[B, Hm, Sk, C]` indices plus the `causal` flag they go with.

    `eq=False` because numpy arrays have no single truth value; compare `.indices` instead.
    """

    indices: np.ndarray
    causal: bool

    def dense(self, q_len: int | None = None) -> np.ndarray:
        """The dense boolean mask `[B, Hm, Sq, Sk]`, True = masked (see `to_dense`)."""
        return to_dense(self.indices, causal=self.causal, q_len=q_len)

    def noncausal(self, q_len: int | None = None) -> Mask:
        """The same mask written for `causal=False` (see `to_noncausal`)."""
        return Mask(to_noncausal(self.indices, causal=self.causal, q_len=q_len), causal=False)


# --------------------------------------------------------------------------------------------
# Builders. Each returns a validated square (Sq = Sk = seq_len) Mask, numpy int32.
# --------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer))


def _per_batch(spec: Sequence[Any], batch: int | None, nested: bool, name: str) -> list[Any]:
    """One spec per batch row: a nested spec is per-row already, a flat one is repeated."""
    if not nested:
        return [spec] * (1 if batch is None else batch)
    if batch is not None and batch != len(spec):
        raise ValueError(f"{name} gives {len(spec)} batch rows but batch={batch}")
    return list(spec)


def _check_lens(lens: Sequence[int], name: str, total: int | None = None) -> list[int]:
    out = [int(n) for n in lens]
    if not out or any(n < 1 for n in out):
        raise ValueError(f"{name} must be a non-empty list of lengths >= 1, got {list(lens)}")
    if total is not None and sum(out) != total:
        raise ValueError(f"{name} {out} sums to {sum(out)}, but every row must sum to {total}")
    return out


def _mask(rows: Sequence[np.ndarray], heads: int, causal: bool) -> Mask:
    """Stack per-batch `[Sk, C]` (shared by all heads) or `[Hm, Sk, C]` arrays into a Mask."""
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    per = [r[None] if r.ndim == 2 else r for r in rows]
    idx = np.stack([np.repeat(r, heads // r.shape[0], axis=0) for r in per]).astype(np.int32)
    return Mask(validate(idx, causal=causal), causal)


def causal_mask(batch: int, seq_len: int, heads: int = 1) -> Mask:
    """Plain causal attention: `[LTS] = Sq` masks nothing beyond the causal triangle."""
    return _mask([np.full((seq_len, 1), seq_len)] * batch, heads, causal=True)


def sliding_window_mask(
    batch: int, seq_len: int, window: int | Sequence[int], heads: int | None = None
) -> Mask:
    """Causal sliding window: row i sees columns (i - window, i], so LTS[j] = min(j + window, S).

    `window` counts the keys a query sees, itself included (flash-attn `window_size=w` is
    window = w + 1). A list gives one window per head.
    """
    windows = [int(window)] if _is_int(window) else [int(w) for w in window]  # type: ignore[union-attr]
    if heads is not None and len(windows) > 1 and heads != len(windows):
        raise ValueError(f"{len(windows)} per-head windows given but heads={heads}")
    if any(w < 1 for w in windows):
        raise ValueError(f"sliding windows must be >= 1 (a query sees itself), got {windows}")
    j = np.arange(seq_len)
    cols = np.stack([np.minimum(j + w, seq_len)[:, None] for w in windows])
    return _mask([cols] * batch, heads or len(windows), causal=True)


def _doc_rows(doc_lens: Sequence[Any], batch: int | None) -> list[list[int]]:
    nested = not _is_int(doc_lens[0]) if len(doc_lens) else False
    per = _per_batch(doc_lens, batch, nested, "doc_lens")
    first = _check_lens(per[0], "doc_lens")
    return [_check_lens(p, "doc_lens", sum(first)) for p in per]


def causal_document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]], batch: int | None = None, heads: int = 1
) -> Mask:
    """Packed documents, causal within each: LTS[j] = end of j's document (1 column).

    `doc_lens` is one list for every batch row, or one list per row; each sums to seq_len.
    """
    rows = [np.repeat(np.cumsum(lens), lens)[:, None] for lens in _doc_rows(doc_lens, batch)]
    return _mask(rows, heads, causal=True)


def sliding_window_document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    window: int,
    *,
    global_tokens: int = 0,
    batch: int | None = None,
    heads: int = 1,
) -> Mask:
    """Packed documents, each causal within a sliding window: a token sees the last `window`
    tokens of its own document (itself included, as `sliding_window_mask`), and with
    `global_tokens` g also the document's first g tokens (global tokens, attention sinks).

    LTS[j] = min(j + window, doc end), or doc end for a global column (1 column, causal).
    """
    if int(window) < 1 or int(global_tokens) < 0:
        raise ValueError(
            f"window must be >= 1 (a query sees itself) and global_tokens >= 0, got "
            f"{window}, {global_tokens}"
        )
    rows = []
    for lens in _doc_rows(doc_lens, batch):
        end = np.repeat(np.cumsum(lens), lens)
        offset = np.arange(len(end)) - (end - np.repeat(lens, lens))  # position in its doc
        lts = np.minimum(np.arange(len(end)) + int(window), end)
        rows.append(np.where(offset < int(global_tokens), end, lts)[:, None])
    return _mask(rows, heads, causal=True)


def document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]], batch: int | None = None, heads: int = 1
) -> Mask:
    """Packed documents, bidirectional within each: [LTS, UTE] = [doc end, doc start]."""
    rows = []
    for lens in _doc_rows(doc_lens, batch):
        end = np.cumsum(lens)
        rows.append(np.stack([np.repeat(end, lens), np.repeat(end - lens, lens)], axis=-1))
    return _mask(rows, heads, causal=False)


def _share_question_row(examples: Sequence[Sequence[int]], seq_len: int) -> np.ndarray:
    lts = np.full(seq_len, seq_len)  # trailing padding: one more causal document
    pos = 0
    for ex in examples:
        parts = _check_lens(ex, "each example (prompt_len, answer_len, ...)")
        if len(parts) < 2:
            raise ValueError(f"an example needs a prompt and at least one answer, got {ex}")
        end = pos + sum(parts)
        if end > seq_len:
            raise ValueError(f"examples need {end} tokens but seq_len is {seq_len}")
        lts[pos : pos + parts[0]] = end  # the prompt is seen by every answer of its example
        pos += parts[0]
        for n in parts[1:]:
            lts[pos : pos + n] = pos + n  # an answer is seen only by itself
            pos += n
    return lts[:, None]


def share_question_mask(
    examples: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
    seq_len: int | None = None,
    batch: int | None = None,
    heads: int = 1,
) -> Mask:
    """DPO packing: examples `(prompt_len, chosen_len, rejected_len, ...)` back to back, causal.

    Each answer sees its prompt and itself, never another answer or another example. Tokens
    after the last example (up to `seq_len`, default the longest row) are padding, treated as
    one more causal document so no row is fully masked. Nest one list of examples per row.
    """
    nested = bool(examples) and bool(examples[0]) and not _is_int(examples[0][0])  # type: ignore[index]
    per = _per_batch(examples, batch, nested, "examples")
    need = max(sum(sum(ex) for ex in row) for row in per)
    total = need if seq_len is None else int(seq_len)
    return _mask([_share_question_row(row, total) for row in per], heads, causal=True)


def prefix_lm_causal_mask(
    batch: int, seq_len: int, prefix_len: int | Sequence[int], heads: int = 1
) -> Mask:
    """Bidirectional over the first `prefix_len` tokens, causal after: [LTS, UTE] = [S, 0 | j].

    `prefix_len` is one int or one per batch row.
    """
    prefixes = [int(prefix_len)] * batch if _is_int(prefix_len) else [int(p) for p in prefix_len]  # type: ignore[union-attr]
    if len(prefixes) != batch or any(not 0 <= p <= seq_len for p in prefixes):
        raise ValueError(f"prefix_len needs {batch} value(s) in [0, {seq_len}], got {prefix_len}")
    j = np.arange(seq_len)
    rows = [np.stack([np.full(seq_len, seq_len), np.where(j < p, 0, j)], -1) for p in prefixes]
    return _mask(rows, heads, causal=False)


def prefix_lm_document_mask(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    prefix_lens: Sequence[int] | Sequence[Sequence[int]],
    batch: int | None = None,
    heads: int = 1,
) -> Mask:
    """Packed prefix-LM documents: each is bidirectional over its prefix and causal after it.

    [LTS, UTE] = [doc end, doc start] in a prefix, [doc end, j] after it.
    """
    docs = _doc_rows(doc_lens, batch)
    nested = bool(prefix_lens) and not _is_int(prefix_lens[0])
    prefs = _per_batch(prefix_lens, len(docs), nested, "prefix_lens")
    rows = []
    for lens, pre in zip(docs, prefs, strict=True):
        pre = [int(p) for p in pre]
        if len(pre) != len(lens) or any(not 0 <= p <= n for p, n in zip(pre, lens, strict=True)):
            raise ValueError(f"prefix_lens {pre} must give one prefix in [0, len] per doc {lens}")
        end = np.cumsum(lens)
        start = np.repeat(end - lens, lens)
        j = np.arange(int(end[-1]))
        ute = np.where(j < start + np.repeat(pre, lens), start, j)
        rows.append(np.stack([np.repeat(end, lens), ute], axis=-1))
    return _mask(rows, heads, causal=False)


def global_sliding_window_mask(
    seq_len: int,
    global_tokens: int,
    window: int | tuple[int, int],
    batch: int = 1,
    heads: int = 1,
) -> Mask:
    """Global tokens plus a bidirectional sliding window (4 columns), as in the FlashMask docs.

    The first `global_tokens` tokens see and are seen by everything; any other row i sees
    columns [i - left, i + right], with `window` = (left, right) or w for (w, w).
    """
    left, right = (int(window), int(window)) if _is_int(window) else map(int, window)  # type: ignore[arg-type]
    if global_tokens < 0 or left < 0 or right < 0:
        raise ValueError(f"global_tokens and window must be >= 0, got {global_tokens}, {window}")
    s, g = seq_len, min(int(global_tokens), seq_len)
    j = np.arange(s)
    lts = np.where(j < g, s, np.minimum(j + left + 1, s))
    ute = j - right
    has_upper = (j >= g) & (ute > g)  # rows [g, j - right) are masked; global rows never are
    cols = [lts, np.full(s, s), np.where(has_upper, g, 0), np.where(has_upper, ute, 0)]
    return _mask([np.stack(cols, axis=-1)] * batch, heads, causal=False)


def causal_blockwise_mask(
    block_lens: Sequence[int] | Sequence[Sequence[int]], batch: int | None = None, heads: int = 1
) -> Mask:
    """Causal blocks that see only themselves, then a last block that sees everything before it.

    [LTS, LTE] = [block end, last block start] (empty ranges written [S, S]), as in the
    FlashMask docs' in-context-learning example.
    """
    rows = []
    for lens in _doc_rows(block_lens, batch):
        end = np.repeat(np.cumsum(lens), lens)
        s, last = len(end), len(end) - lens[-1]
        empty = end >= last
        rows.append(np.stack([np.where(empty, s, end), np.where(empty, s, last)], axis=-1))
    return _mask(rows, heads, causal=True)


def random_eviction_mask(batch: int, seq_len: int, heads: int = 1, seed: int = 0) -> Mask:
    """KV-cache eviction: column j is evicted from a random row LTS[j] in [j + 1, S] onward.

    S means never evicted; LTS > j keeps the diagonal so no row is fully masked. Every
    (batch, head) draws its own rows from `seed`.
    """
    low = np.arange(seq_len) + 1
    lts = np.random.default_rng(seed).integers(low, seq_len + 1, size=(batch, heads, seq_len))
    return _mask(list(lts[..., None]), heads, causal=True)


def qk_sparse_mask(
    seq_len: int, spans: Sequence[tuple[int, int]], batch: int = 1, heads: int = 1
) -> Mask:
    """QK-sparse: inside each span (start, length) queries do not see the span's keys.

    A row in a span sees the tokens before the span only; later rows see everything (causal).
    [LTS, LTE] = [j, span end] for a span column, [S, S] elsewhere. A span at 0 leaves its
    first row fully masked.
    """
    lts = np.full(seq_len, seq_len)
    lte = np.full(seq_len, seq_len)
    pos = 0
    for start, length in spans:
        if start < pos or length < 1 or start + length > seq_len:
            raise ValueError(
                f"spans must be sorted, non-overlapping (start, length >= 1) inside "
                f"[0, {seq_len}], got {list(spans)}"
            )
        pos = start + length
        lts[start:pos] = np.arange(start, pos)
        lte[start:pos] = pos
    return _mask([np.stack([lts, lte], axis=-1)] * batch, heads, causal=True)


# --------------------------------------------------------------------------------------------
# The mask a run gives each packed document (`attention.mask` and its parameters).
# --------------------------------------------------------------------------------------------

DOCUMENT_MASKS: tuple[str, ...] = ("causal", "sliding_window", "global_window", "prefix_lm")
"""What a language-model run can give each packed document (`DocumentMasking.kind`)."""


@dataclass(frozen=True)
class DocumentMasking:
    """The mask of every packed document of a sequence (none sees another document):

    * `causal`: the earlier tokens of its document (`causal_document_mask`);
    * `sliding_window`: the last `window` of them, itself included
      (`sliding_window_document_mask`);
    * `global_window`: those and the document's first `global_tokens` tokens (the same);
    * `prefix_lm`: the whole prefix (bidirectional), then causal (`prefix_lm_document_mask`;
      each segment's prefix length given to `build`).
    """

    kind: str = "causal"
    window: int | None = None
    global_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DOCUMENT_MASKS:
            raise ValueError(f"document mask {self.kind!r}: expected one of {DOCUMENT_MASKS}")
        if self.windowed and (self.window is None or self.window < 1):
            raise ValueError(f"a {self.kind} mask needs a window >= 1, got {self.window}")
        if self.kind == "global_window" and self.global_tokens < 1:
            raise ValueError(f"a global_window mask needs global_tokens >= 1, got "
                             f"{self.global_tokens}")  # fmt: skip

    @property
    def windowed(self) -> bool:
        """Whether a token sees only a window of its document."""
        return self.kind in ("sliding_window", "global_window")

    def describe(self) -> str:
        """`sliding_window 4096` / `global_window 4 + 4096` / `prefix_lm` / `causal`."""
        if self.kind == "sliding_window":
            return f"sliding_window {self.window}"
        if self.kind == "global_window":
            return f"global_window {self.global_tokens} + {self.window}"
        return self.kind

    @property
    def uses_prefixes(self) -> bool:
        """Whether `build` reads each segment's prefix length."""
        return self.kind == "prefix_lm"

    def build(
        self,
        doc_lens: Sequence[Sequence[int]],
        prefix_lens: Sequence[Sequence[int]] | None = None,
        heads: int = 1,
    ) -> Mask:
        """The `[B, heads, S, C]` mask of B rows of segments `doc_lens[b]` (prefix_lm: with
        their prefix lengths `prefix_lens[b]`, 0 for none)."""
        batch = len(doc_lens)
        if self.kind == "causal":
            return causal_document_mask(doc_lens, batch=batch, heads=heads)
        if self.windowed:
            extra = self.global_tokens if self.kind == "global_window" else 0
            return sliding_window_document_mask(
                doc_lens, int(self.window or 0), global_tokens=extra, batch=batch, heads=heads
            )
        if prefix_lens is None:
            raise ValueError("a prefix_lm mask needs each segment's prefix length")
        return prefix_lm_document_mask(doc_lens, prefix_lens, batch=batch, heads=heads)
