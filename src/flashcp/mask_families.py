"""`FAMILIES`: one seeded generator per FlashMask family (`flashcp.masks` builders), for
parametrized kernel, CP and attention tests and the benchmarks; no training path uses them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flashcp.masks import (
    Mask,
    causal_blockwise_mask,
    causal_document_mask,
    causal_mask,
    document_mask,
    global_sliding_window_mask,
    prefix_lm_causal_mask,
    prefix_lm_document_mask,
    qk_sparse_mask,
    random_eviction_mask,
    share_question_mask,
    sliding_window_mask,
)


def _partition(rng: np.random.Generator, total: int, mins: Sequence[int]) -> list[int]:
    """Random sizes summing to `total`, size k at least mins[k]."""
    extra = total - sum(mins)
    cuts = np.sort(rng.integers(0, extra + 1, size=len(mins) - 1))
    return [int(d) + m for d, m in zip(np.diff([0, *cuts, extra]), mins, strict=True)]


def _random_docs(rng: np.random.Generator, seq_len: int) -> list[int]:
    return _partition(rng, seq_len, [1] * int(rng.integers(1, min(4, seq_len) + 1)))


def _stack(masks: Sequence[Mask]) -> Mask:
    """Concatenate batch-1 masks of one family into a batch."""
    return Mask(np.concatenate([m.indices for m in masks]), masks[0].causal)


def _fam_causal(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    return causal_mask(batch, seq_len, heads)


def _fam_sliding_window(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    window = int(np.random.default_rng(seed).integers(1, max(1, seq_len // 2) + 1))
    return sliding_window_mask(batch, seq_len, window, heads)


def _fam_sliding_window_per_head(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    windows = np.random.default_rng(seed).integers(1, seq_len + 1, size=heads)
    return sliding_window_mask(batch, seq_len, list(windows))


def _fam_causal_document(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    return causal_document_mask([_random_docs(rng, seq_len) for _ in range(batch)], heads=heads)


def _fam_document(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    return document_mask([_random_docs(rng, seq_len) for _ in range(batch)], heads=heads)


def _fam_share_question(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        n = int(rng.integers(1, min(3, seq_len // 3) + 1)) if seq_len >= 3 else 0
        pad = int(rng.integers(0, (seq_len - 3 * n) // 4 + 1))
        lens = _partition(rng, seq_len - pad, [3] * n) if n else []
        examples = [_partition(rng, n_tok, [1, 1, 1]) for n_tok in lens]
        rows.append(share_question_mask(examples, seq_len=seq_len, heads=heads))
    return _stack(rows)


def _fam_prefix_lm_causal(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    prefixes = np.random.default_rng(seed).integers(0, seq_len + 1, size=batch)
    return prefix_lm_causal_mask(batch, seq_len, list(prefixes), heads)


def _fam_prefix_lm_document(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    docs = [_random_docs(rng, seq_len) for _ in range(batch)]
    prefixes = [[int(rng.integers(0, n + 1)) for n in lens] for lens in docs]
    return prefix_lm_document_mask(docs, prefixes, heads=heads)


def _fam_global_sliding_window(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    g = int(rng.integers(1, max(1, seq_len // 8) + 1))
    left, right = (int(w) for w in rng.integers(0, max(1, seq_len // 4) + 1, size=2))
    return global_sliding_window_mask(seq_len, g, (left, right), batch, heads)


def _fam_causal_blockwise(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    return causal_blockwise_mask([_random_docs(rng, seq_len) for _ in range(batch)], heads=heads)


def _fam_random_eviction(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    return random_eviction_mask(batch, seq_len, heads, seed)


def _fam_qk_sparse(batch: int, seq_len: int, heads: int, seed: int) -> Mask:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        n = int(rng.integers(1, 3)) if seq_len >= 2 * 2 else int(seq_len >= 2)
        # gap (>= 1, so row 0 sees itself), span, gap, span, ..., trailing gap
        sizes = _partition(rng, seq_len, [1] + [1, 0] * n) if n else []
        starts = np.cumsum([0, *sizes])
        spans = [(int(starts[2 * k + 1]), sizes[2 * k + 1]) for k in range(n)]
        rows.append(qk_sparse_mask(seq_len, spans, heads=heads))
    return _stack(rows)


FAMILIES: dict[str, Callable[[int, int, int, int], Mask]] = {
    "causal": _fam_causal,
    "sliding_window": _fam_sliding_window,
    "sliding_window_per_head": _fam_sliding_window_per_head,
    "causal_document": _fam_causal_document,
    "document": _fam_document,
    "share_question": _fam_share_question,
    "prefix_lm_causal": _fam_prefix_lm_causal,
    "prefix_lm_document": _fam_prefix_lm_document,
    "global_sliding_window": _fam_global_sliding_window,
    "causal_blockwise": _fam_causal_blockwise,
    "random_eviction": _fam_random_eviction,
    "qk_sparse": _fam_qk_sparse,
}
"""Family name -> `(batch, seq_len, heads, seed) -> Mask` of shape `[batch, heads, seq_len, C]`.

Square (Sq = Sk = seq_len), deterministic in `seed`, valid for any seq_len >= 1, and no query
row is fully masked. Per-row parameters (document lengths, windows, ...) are drawn from `seed`.
"""
