"""Inputs for in-process tests: documents for the data pipeline (packing, CP sharding) and model
inputs for the decoder stack (recompute, offload, tiling, residual dtype, LoRA, parameter dtype):
random token ids, their positions and a causal attention context."""

from __future__ import annotations

import numpy as np
import paddle

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.data import Document


def marked_documents(lengths: list[int], seed: int = 0) -> list[Document]:
    """Documents of `lengths` random tokens (below 250) from `seed`; document i starts with the
    marker token 1000 + i, which is no target (every other token is)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, 250, size=n).astype(np.int64)
        tokens[0] = 1000 + i  # marks the start of document i
        targets = np.ones(n, dtype=bool)
        targets[0] = False
        out.append(Document(tokens, targets))
    return out


def packed_batch(
    seq: int = 32, seed: int = 0, vocab: int = 260, *, batch: int = 2
) -> tuple[paddle.Tensor, paddle.Tensor, AttentionContext]:
    """`batch` rows of `seq` token ids drawn from `seed`, their positions, and an attention
    context whose causal mask packs two documents per row (cut at a third of the row)."""
    rng = np.random.default_rng(seed)
    ids = paddle.to_tensor(rng.integers(0, vocab, (batch, seq)), dtype="int64")
    pos = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
    cut = seq // 3
    mask = masks.causal_document_mask([cut, seq - cut], batch=batch).indices
    return ids, pos, AttentionContext(mask=mask, causal=True)


def causal_batch(
    seq: int = 24, seed: int = 1, vocab: int = 256, *, batch: int = 2
) -> tuple[paddle.Tensor, paddle.Tensor, AttentionContext]:
    """`batch` rows of `seq` token ids drawn from `seed`, their positions, and a plain causal
    attention context (one document per row, no mask)."""
    rng = np.random.default_rng(seed)
    ids = paddle.to_tensor(rng.integers(0, vocab, (batch, seq)).astype("int64"))
    pos = paddle.to_tensor(np.tile(np.arange(seq), (batch, 1)).astype("int64"))
    return ids, pos, AttentionContext(mask=None, causal=True)
