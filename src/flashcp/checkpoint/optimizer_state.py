"""Optimizer state in checkpoint files: the one place that knows how it is laid out, which rank
writes which file, and how any saved layout is read back into any other.

The optimizers hand out their state layout-neutrally, as `flashcp.optim.adamw.StatePiece`s
(parameter, element range of the full tensor, arrays by kind; `state_pieces()`), and take it in
through an `flashcp.optim.adamw.OptimizerSource` (`load_state`). The kinds and Paddle's names
for them are `flashcp.optim.adamw.ACCUMULATORS`'. Two saved forms:

* unsharded (`classic_arrays`, `ParamOptimizer`): `<name>::<accumulator>` arrays (`state_key`:
  `::moment1_0`, `::moment2_0`, `::beta1_pow_acc_0`, `::beta2_pow_acc_0`) of the parameter
  shapes, keyed by the parameter's structured name; the float32 parameters themselves are the
  master weights. Under expert parallelism the moments are gathered to the whole tensors
  (`optimizer_key`, `flashcp.checkpoint.experts`);
* shards (`MasterOptimizer`, one file per rank of a stage that writes one: `shard_file`,
  `writes_shard_file`, `shard_files`): packed float32 arrays, one per kind of `SHARD_ARRAYS`
  (`master`, `moment1`, `moment2`: the rank's segments back to back; `beta1_pow`, `beta2_pow`:
  one entry per segment), with the segment map `[name, start, length, offset]` in the
  safetensors metadata (`SHARD_META`): the segment holds elements `[start, start + length)` of
  the flattened parameter `name` (of the FULL tensor: an expert-parallel rank's rows are offset
  by its first expert), at `offset` in the packed arrays.

Either form is read by (parameter, element range), so a checkpoint written by one dp × cp × ep
(or unsharded) loads into any other: `ClassicSource` slices the full arrays, `ShardSource`
stitches a range together from the pieces of several shard files, reading only those bytes
(`safetensors.safe_open` slices).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from flashcp.config.schema import TrainConfig
from flashcp.optim.adamw import (
    ACCUMULATORS,
    BETA_POWS,
    MOMENTS,
    OptimizerSource,
    StatePiece,
    fresh_state,
)
from flashcp.optim.master_optimizer import MasterOptimizer

SEP = "::"
"""`<structured parameter name>::<accumulator>`: the unsharded form's keys."""
SHARD_META = "flashcp_optimizer_shard"
"""safetensors metadata key of a shard file's segment map (JSON)."""
SHARD_ARRAYS = ("master", *ACCUMULATORS)
"""The packed arrays of a shard file, by kind."""


# -- the unsharded form ----------------------------------------------------------------------------


def state_key(name: str, kind: str) -> str:
    """The unsharded form's key of accumulator `kind` of parameter `name` (structured)."""
    return f"{name}{SEP}{ACCUMULATORS[kind]}"


def optimizer_key(key: str) -> str | None:
    """The parameter whose rows an unsharded-form array holds: the moments' (sliced and
    gathered like the parameter under expert parallelism, `flashcp.checkpoint.experts`); None
    for the beta powers."""
    name, _, acc = key.partition(SEP)
    return name if acc in MOMENTS.values() else None


def classic_arrays(pieces: Iterable[StatePiece]) -> dict[str, np.ndarray]:
    """The unsharded form of whole parameters' state (`ParamOptimizer.state_pieces()`); a
    parameter not stepped yet has no entries."""
    return {
        state_key(piece.name, kind): value
        for piece in pieces
        for kind, value in piece.arrays.items()
        if kind in ACCUMULATORS
    }


# -- shard files -----------------------------------------------------------------------------------


@dataclass
class ShardArrays:
    """One shard file: the packed arrays by kind (`SHARD_ARRAYS`), the segment map, every
    parameter's full element count, and the file's place (`index` of `shards`)."""

    segments: list[tuple[str, int, int, int]]
    numel: dict[str, int]
    shards: int
    index: int
    packed: dict[str, np.ndarray]
    """Kind → the packed array."""

    def tensors(self) -> dict[str, np.ndarray]:
        """The packed arrays by kind (contiguous float32)."""
        return {k: np.ascontiguousarray(self.packed[k], dtype=np.float32) for k in SHARD_ARRAYS}

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata: the segment map and the shard's place, as JSON."""
        meta = {
            "segments": [list(s) for s in self.segments],
            "numel": self.numel,
            "shards": self.shards,
            "index": self.index,
        }
        return {SHARD_META: json.dumps(meta, sort_keys=True)}


def pack_shard(
    pieces: Sequence[StatePiece],
    *,
    numel: Mapping[str, int],
    shards: int,
    index: int,
    train: TrainConfig,
) -> ShardArrays:
    """Master pieces (`MasterShard.state_pieces()`) packed back to back into one shard file's
    arrays; a piece without AdamW state yet (not stepped) saves AdamW's fresh state."""
    segments: list[tuple[str, int, int, int]] = []
    columns: dict[str, list[np.ndarray]] = {kind: [] for kind in SHARD_ARRAYS}
    offset = 0
    for piece in pieces:
        segments.append((piece.name, piece.start, piece.length, offset))
        offset += piece.length
        values = piece.arrays
        if not set(ACCUMULATORS) <= set(values):
            values = {**fresh_state(train, piece.length), **values}
        for kind, column in columns.items():
            column.append(values[kind].reshape(-1))
    packed = {
        kind: np.concatenate(column) if column else np.zeros(0, np.float32)
        for kind, column in columns.items()
    }
    return ShardArrays(segments, dict(numel), shards, index, packed)


def _per_ep_rank(opt: MasterOptimizer) -> bool:
    """Unsharded under expert parallelism: one file per ep rank (the same count on every
    stage, whether or not it trains experts)."""
    return not opt.sharded and int(opt.ep.nranks) > 1


def shard_files(opt: MasterOptimizer) -> int:
    """Optimizer shard files per pipeline stage: one per rank (ZeRO-1), one per ep rank
    (unsharded under ep: its experts, the first also the replicated parameters), else one."""
    if opt.sharded:
        return opt.shards
    return int(opt.ep.nranks) if _per_ep_rank(opt) else 1


def writes_shard_file(opt: MasterOptimizer) -> bool:
    """Whether this rank writes an optimizer shard file (`shard_file`)."""
    if opt.sharded:
        return True
    if _per_ep_rank(opt):
        return int(opt.edp.rank) == 0
    return int(opt.cp.rank) == 0 and int(opt.dp.rank) == 0


def shard_file(opt: MasterOptimizer) -> ShardArrays:
    """This rank's optimizer shard file: its segments of every part (without ZeRO-1 under
    ep, only the first ep rank adds the replicated parameters, which every ep rank holds)."""
    held = opt.held
    pieces = opt.state_pieces()
    per_ep_rank = _per_ep_rank(opt)
    if per_ep_rank and int(opt.ep.rank) > 0:
        pieces = [p for p in pieces if p.name in held.experts]
    return pack_shard(
        pieces,
        numel={n: held.full_numel(n) for n, _ in held.params},
        shards=shard_files(opt),
        index=int(opt.ep.rank) if per_ep_rank else opt.layout.index,  # unsharded: index 0
        train=opt.train,
    )


# -- reading either form ---------------------------------------------------------------------------


class ClassicSource:
    """The unsharded form (a dict of `<name>::<accumulator>` arrays)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        if kind not in MOMENTS:
            return None  # the float32 parameters are the masters
        key = state_key(name, kind)
        value = self.arrays.get(key)
        if value is None:
            return None
        flat = value.reshape(-1)
        if start + length > flat.size:
            raise ValueError(
                f"checkpoint state {key} has {flat.size} elements, the model's parameter at "
                f"least {start + length} (saved with another model config?)"
            )
        return np.asarray(flat[start : start + length], dtype=np.float32)

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        pair = [self.arrays.get(state_key(name, kind)) for kind in BETA_POWS]
        if pair[0] is None or pair[1] is None:
            return None
        return pair[0].reshape(1), pair[1].reshape(1)


class ShardSource:
    """Shard files, grouped by the pipeline stage that wrote them (any dp × cp wrote them).

    A parameter held by two stages (a tied embedding) is read from the first stage holding it:
    both copies are equal, but each stage cut its own shard boundaries.
    """

    def __init__(self, stages: Sequence[Sequence[str | Path]]) -> None:
        self.files: list[Any] = []
        self.pieces: dict[str, list[tuple[int, int, int, int, int]]] = {}
        """name -> [(start, length, file index, offset, segment index)], sorted by start."""
        owner: dict[str, int] = {}
        for stage, paths in enumerate(stages):
            for path in paths:
                handle = safe_open(str(path), framework="numpy")
                meta_text = (handle.metadata() or {}).get(SHARD_META)
                if meta_text is None:
                    raise ValueError(f"{path} is not a flashcp optimizer shard (no segment map)")
                meta = json.loads(meta_text)
                f = len(self.files)
                self.files.append(handle)
                for i, (name, start, length, offset) in enumerate(meta["segments"]):
                    if owner.setdefault(name, stage) != stage:
                        continue
                    self.pieces.setdefault(name, []).append((start, length, f, offset, i))
        for items in self.pieces.values():
            items.sort()

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        items = self.pieces.get(name)
        if items is None:
            return None
        out = np.empty(length, np.float32)
        covered = 0
        end = start + length
        for p_start, p_len, f, offset, _ in items:
            a, z = max(start, p_start), min(end, p_start + p_len)
            if a >= z:
                continue
            lo = offset + (a - p_start)
            out[a - start : z - start] = self.files[f].get_slice(kind)[lo : lo + (z - a)]
            covered += z - a
        if covered != length:
            raise ValueError(
                f"the checkpoint's optimizer shards cover {covered} of elements "
                f"[{start}, {end}) of {name!r}: a shard file is missing"
            )
        return out

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        items = self.pieces.get(name)
        if items is None:
            return None
        _, _, f, _, i = items[0]
        b1, b2 = (np.asarray(self.files[f].get_slice(k)[i : i + 1], np.float32) for k in BETA_POWS)
        return b1, b2


def source_for(
    classic: Mapping[str, np.ndarray], shard_files: Sequence[Sequence[str | Path]]
) -> OptimizerSource:
    """The source of a loaded checkpoint: its shard files (per stage) if it has any, else its
    unsharded arrays."""
    if any(shard_files):
        return ShardSource(shard_files)
    return ClassicSource(classic)
