"""Mask variants shared by the kernel, CP and mask tests.

`overshoot` writes a mask in upstream FlashMask's "values >= Sq" form: every threshold at or
past the last query row ("through the last row") gets a random value in [Sq, 2**31 - 1]
instead of Sq. Upstream reads all of them as Sq, so the result must be indistinguishable from
the original (`flashcp.mask_indices.clip_rows` maps it back exactly).
"""

from __future__ import annotations

import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)


def overshoot(idx: np.ndarray, q_len: int, seed: int = 0) -> np.ndarray:
    """`idx` (int32) with every value >= `q_len` replaced by a random value in
    [q_len, 2**31 - 1]; about a third of them are exactly 2**31 - 1."""
    idx = np.asarray(idx)
    rng = np.random.default_rng(seed)
    high = rng.integers(q_len, INT32_MAX, size=idx.shape, endpoint=True)
    high[rng.random(idx.shape) < 0.3] = INT32_MAX
    return np.where(idx >= q_len, high, idx).astype(np.int32)
