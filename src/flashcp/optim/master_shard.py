"""One rank's float32 master weights: slices of the parameters (`flashcp.optim.layout`
segments) and Paddle's AdamW over them, with no communication of its own. `MasterOptimizer`
(`flashcp.optim.master_optimizer`) moves the gradients and masters between the ranks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import paddle
from paddle.base.framework import EagerParamBase

from flashcp.config.schema import TrainConfig
from flashcp.device import host_array
from flashcp.optim.adamw import (
    OptimizerSource,
    StatePiece,
    adamw_state,
    build_adamw,
    load_adamw_state,
)
from flashcp.optim.layout import Segment, ShardLayout
from flashcp.optim.trainable import dtype_name


def flat_slice(p: paddle.Tensor, start: int, length: int) -> paddle.Tensor:
    """A float32 copy of elements [start, start + length) of flattened `p`."""
    with paddle.no_grad():
        piece = p.reshape([-1])[start : start + length]
        return piece.astype("float32") if dtype_name(p) != "float32" else piece.clone()


class MasterShard:
    """One rank's float32 master slices of the parameters and Paddle's AdamW over them.

    No communication: the caller hands in each bucket's summed gradient slice (`set_grads`)
    and reads back the updated masters (`piece`). `params` maps structured names to the
    parameters (initial masters are their values, cast to float32).
    """

    def __init__(
        self,
        layout: ShardLayout,
        params: dict[str, paddle.Tensor],
        train: TrainConfig,
        scheduler: Any,
        offsets: Mapping[str, int] | None = None,
    ) -> None:
        self.layout = layout
        self.train = train
        self.segments: list[Segment] = layout.segments()
        self.params = params
        self.offsets = dict(offsets or {})
        """Where a parameter's elements start in the full tensor's (expert rows: the first
        expert held × elements per expert); state goes out and comes in in those coordinates."""
        self.masters: list[paddle.Tensor] = [
            EagerParamBase.from_tensor(flat_slice(params[seg.name], seg.start, seg.length))
            for seg in self.segments
        ]
        self.decay = {
            m.name
            for seg, m in zip(self.segments, self.masters, strict=True)
            if len(params[seg.name].shape) >= 2
        }
        """Masters with weight decay: those of matrices and embeddings (by the parameter)."""
        self.by_bucket: dict[int, list[int]] = {}
        for i, seg in enumerate(self.segments):
            self.by_bucket.setdefault(seg.bucket, []).append(i)
        self.inner = build_adamw(self.masters, train, scheduler, self.decay)

    def set_grads(self, b: int, piece: paddle.Tensor | None) -> None:
        """Bucket `b`'s summed gradient slice of this shard (`layout.piece(b)` elements) becomes
        the gradient of its segments (a parameter that got no gradient has zeros there and is
        stepped, in every layout: `flashcp.optim.grads.fill_missing_grads`)."""
        for i in self.by_bucket.get(b, []):
            seg = self.segments[i]
            if piece is None:
                self.masters[i].grad = None
            else:
                self.masters[i].grad = piece[seg.piece_offset : seg.piece_offset + seg.length]

    def grads(self) -> Iterable[tuple[str, paddle.Tensor | None]]:
        """`(parameter name, gradient of its segment)` of every segment."""
        return ((seg.name, m.grad) for seg, m in zip(self.segments, self.masters, strict=True))

    @paddle.no_grad()
    def scale_grads(self, scale: paddle.Tensor) -> None:
        for m in self.masters:
            if m.grad is not None:
                m.grad = paddle.multiply(m.grad, scale)

    def step(self) -> None:
        if self.masters:
            self.inner.step()

    def clear_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @paddle.no_grad()
    def piece(self, b: int) -> paddle.Tensor:
        """This shard's slice of bucket `b` from the masters (zeros where it is padding)."""
        parts = [self.masters[i] for i in self.by_bucket.get(b, [])]
        pad = self.layout.piece(b) - sum(self.segments[i].length for i in self.by_bucket.get(b, []))
        if pad:
            parts.append(paddle.zeros([pad], dtype="float32"))
        return paddle.concat(parts) if len(parts) > 1 else parts[0].clone()

    # -- state ------------------------------------------------------------------------------

    def _entries(self) -> list[tuple[paddle.Tensor, str, int]]:
        """`(master, parameter name, its first element in the full tensor)` per segment."""
        starts = [seg.start + self.offsets.get(seg.name, 0) for seg in self.segments]
        names = [seg.name for seg in self.segments]
        return list(zip(self.masters, names, starts, strict=True))

    def state_pieces(self) -> list[StatePiece]:
        """Every segment's master weights and AdamW state."""
        pieces = adamw_state(self.inner, self._entries())
        return [
            StatePiece(p.name, p.start, p.length, {"master": host_array(m), **p.arrays})
            for p, m in zip(pieces, self.masters, strict=True)
        ]

    def load(self, source: OptimizerSource) -> None:
        """Masters and AdamW state of every segment from `source` (any saved layout). Without a
        saved master (an unsharded float32 checkpoint) the master is the parameter's value; a
        parameter without any saved state starts fresh, as Paddle's AdamW would."""
        entries = self._entries()
        for seg, (m, _, start) in zip(self.segments, entries, strict=True):
            master = source.read(seg.name, "master", start, seg.length)
            if master is None:
                master = flat_slice(self.params[seg.name], seg.start, seg.length).numpy()
            m.set_value(master.astype(np.float32, copy=False))
        load_adamw_state(self.inner, entries, source)
