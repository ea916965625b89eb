"""Multi-token prediction (MTP): GLM-4.5's "NextN" layers, as DeepSeek-V3 defines them.

`model.mtp_layers: D` adds D MTP layers after the last decoder layer, on the last pipeline
stage, named as the Hugging Face checkpoints and the serving engines name them (SGLang's
``glm4_moe_nextn``, vLLM's ``glm4_moe_mtp``): layer ``model.layers.{num_layers + d}`` is a
full decoder block of the family (its MoE holding this ep rank's experts) plus

    embed_tokens  its own copy of the token embedding  [V, H]
    enorm, hnorm  norms of the embedding and of the incoming hidden state
    eh_proj       [2H] -> [H], no bias, on concat(enorm(embedding), hnorm(hidden))
    shared_head   .norm then .head [H] -> [V]: the layer's logits

Depth d (1-based) at position i combines the hidden state the previous depth gave at i (the
main model's FINAL-NORM hidden state for d = 1, the serving engines' "previous hidden
states") with the embedding of token i+d, runs its block under the same FlashMask mask and
positions, and predicts token i+d+1 (`mtp_targets`). The embedding and head are the layer's
own tensors, as the checkpoints store and the engines load them, not tied to the main model's
(DeepSeek-V3 shares them; flashcp keeps what the checkpoint holds so an export is bitwise).

`model.mtp_loss_weight: λ` trains them: loss = main + λ · mean over depths of the MTP
cross-entropy (`flashcp.recipes.lm`); λ = 0 carries them frozen (loaded, saved, exported,
never run). Targets and the shifted token ids are built on the FULL sequence before the CP
cut, as the main labels are (`mtp_targets`), so a chunk boundary never loses a target and a
packed document never predicts across its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import paddle
from paddle import nn

from flashcp.models.config import ModelArgs
from flashcp.models.head import IGNORE_INDEX
from flashcp.models.layers import embedding, linear

MTP_PARTS = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
"""The sublayers an MTP layer has beside its decoder block (HF names)."""


class SharedHead(nn.Layer):
    """An MTP layer's output head: `norm`, then `head` (`[H] -> [V]`, no bias)."""

    def __init__(self, args: ModelArgs, make_norm: Callable[[int, float], nn.Layer]) -> None:
        super().__init__()
        self.norm = make_norm(args.hidden_size, args.norm_eps)
        self.head = linear(
            args.hidden_size, args.vocab_size, bias=False, std=args.initializer_range
        )

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits `[..., V]` of an MTP block's output `[..., H]`."""
        return self.head(self.norm(hidden)).astype("float32")


def add_mtp_parts(
    layer: nn.Layer, args: ModelArgs, make_norm: Callable[[int, float], nn.Layer]
) -> nn.Layer:
    """Give decoder layer `layer` (built at index num_layers + d) the MTP parts (`MTP_PARTS`)."""
    h, std = args.hidden_size, args.initializer_range
    layer.embed_tokens = embedding(args.vocab_size, h, std=std)
    layer.enorm = make_norm(h, args.norm_eps)
    layer.hnorm = make_norm(h, args.norm_eps)
    layer.eh_proj = linear(2 * h, h, bias=False, std=std)
    layer.shared_head = SharedHead(args, make_norm)
    layer.is_mtp = True
    return layer


def mtp_block_input(layer: nn.Layer, hidden: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
    """`eh_proj(concat(enorm(embed(ids)), hnorm(hidden)))`, float32 `[B, L, H]`: what MTP layer
    `layer`'s block runs on (`hidden`: the previous depth's float32 hidden states at the same
    positions, `ids`: the tokens one depth further on)."""
    e = layer.enorm(layer.embed_tokens(ids))
    return layer.eh_proj(paddle.concat([e, layer.hnorm(hidden.astype("float32"))], axis=-1))


def is_mtp_layer(layer: nn.Layer) -> bool:
    """Whether `layer` is an MTP layer (a decoder block with `add_mtp_parts`)."""
    return bool(getattr(layer, "is_mtp", False))


def freeze_mtp_layers(model: nn.Layer) -> int:
    """Mark every parameter of `model`'s MTP layers as not trained (`model.mtp_loss_weight`
    0: carried frozen); returns how many layers."""
    layers = [layer for layer in model.sublayers() if is_mtp_layer(layer)]
    for layer in layers:
        for p in layer.parameters():
            p.stop_gradient = True
    return len(layers)


def document_ids(doc_lens: Sequence[Sequence[int]], seq_len: int) -> np.ndarray:
    """`[B, S]` index of the packed document (segment) each position belongs to."""
    rows = []
    for lens in doc_lens:
        ids = np.repeat(np.arange(len(lens), dtype=np.int64), np.asarray(lens, dtype=np.int64))
        if ids.shape[0] != seq_len:
            raise ValueError(
                f"document lengths {list(lens)} sum to {ids.shape[0]}, not the sequence "
                f"length {seq_len}"
            )
        rows.append(ids)
    return np.stack(rows)


def mtp_targets(
    input_ids: np.ndarray,
    labels: np.ndarray,
    doc_lens: Sequence[Sequence[int]],
    depths: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The MTP inputs and targets of FULL sequences: `(ids, targets)`, int64 `[D, B, S]`.

    Depth d (1-based) at position i takes token i+d (`ids[d-1, :, i]`) and predicts token
    i+d+1, which is the main label at i+d (`labels` are shifted already, `IGNORE_INDEX` where
    no target: a document's end, a prompt token, padding); it is a target only when i and
    i+d are in the same packed document, so no depth predicts across a document's end.
    Positions past the sequence's end take token 0 and no target.
    """
    tokens = np.asarray(input_ids, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    batch, seq = tokens.shape
    docs = document_ids(doc_lens, seq)
    ids = np.zeros((depths, batch, seq), dtype=np.int64)
    targets = np.full((depths, batch, seq), IGNORE_INDEX, dtype=np.int64)
    for d in range(1, depths + 1):
        if d >= seq:
            continue
        ids[d - 1, :, : seq - d] = tokens[:, d:]
        same = docs[:, : seq - d] == docs[:, d:]
        targets[d - 1, :, : seq - d] = np.where(same, labels[:, d:], IGNORE_INDEX)
    return ids, targets
