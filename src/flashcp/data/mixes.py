"""Seeded length distributions of the data balancer's benchmark and tests (`flashcp.data.balance`).

Lengths only, in tokens: the balancer plans from lengths, so these stand in for a corpus.

* `long_tail`: pretraining / long-context SFT documents, lognormal with a median of 1.5K
  tokens and σ = 1.4, capped at 128K: a few documents of tens of thousands of tokens among
  many short ones (first-fit at 32K rows, dp 8: per-step work max/mean ≈ 1.20);
* `chat`: short conversations, lognormal with a median of 600 tokens and σ = 0.8, capped at
  16K;
* `dpo`: preference pairs `(prompt, chosen, rejected)`, prompts lognormal (median 800, σ 1.2),
  answers lognormal (median 300, σ 0.8), the prompt kept within half a row and each answer
  cut to share the rest (as `dpo.truncation: truncate` does).
"""

from __future__ import annotations

import numpy as np

LONG_TAIL_CAP = 131072


def _lognormal(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return np.exp(np.log(median) + sigma * rng.standard_normal(n))


def long_tail(n: int, seed: int = 0, *, cap: int = LONG_TAIL_CAP) -> np.ndarray:
    """`n` document lengths of the long-tail mix (module docstring), int64."""
    x = _lognormal(np.random.default_rng([seed, 1]), n, 1500.0, 1.4)
    return np.clip(x, 2, cap).astype(np.int64)


def chat(n: int, seed: int = 0, *, cap: int = 16384) -> np.ndarray:
    """`n` conversation lengths of the chat mix (module docstring), int64."""
    x = _lognormal(np.random.default_rng([seed, 2]), n, 600.0, 0.8)
    return np.clip(x, 2, cap).astype(np.int64)


def dpo(n: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` preference pairs of the DPO mix fitted to rows of `seq_len` tokens: the prompt
    lengths (its shared part in a packed row, `len(prompt) - 1`) and the two answers'."""
    rng = np.random.default_rng([seed, 3])
    prompt = np.clip(_lognormal(rng, n, 800.0, 1.2), 1, seq_len // 2).astype(np.int64)
    room = (seq_len - prompt) // 2
    chosen = np.clip(_lognormal(rng, n, 300.0, 0.8), 1, room).astype(np.int64)
    rejected = np.clip(_lognormal(rng, n, 300.0, 0.8), 1, room).astype(np.int64)
    return prompt, chosen, rejected
