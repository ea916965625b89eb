"""Optimizer state in checkpoints, whatever layout wrote it and whatever layout reads it.

Two saved forms:

* unsharded (`flashcp.optim.adamw.adamw_arrays`): `<name>::<accumulator>` arrays
  (`flashcp.optim.adamw.state_key`: `::moment1_0`, `::moment2_0`, `::beta1_pow_acc_0`,
  `::beta2_pow_acc_0`) of the full parameter shapes; the float32 parameters themselves are the
  master weights;
* shards (`flashcp.optim.zero.ShardArrays`, one file per rank of a stage): packed float32
  arrays `master` and one per accumulator kind (`moment1`, `moment2`: the rank's segments back
  to back; `beta1_pow`, `beta2_pow`: one entry per segment), with the segment map
  `[name, start, length, offset]` in the safetensors metadata (`SHARD_META`, `shard_metadata`):
  the segment holds elements `[start, start + length)` of the flattened parameter `name`, at
  `offset` in the packed arrays.

Both are read through `flashcp.optim.adamw.OptimizerSource`, by (parameter, element range),
so a checkpoint written by one dp × cp (or unsharded) loads into any other: `ClassicSource`
slices the full arrays, `ShardSource` stitches a range together from the pieces of several
shard files, reading only those bytes (`safetensors.safe_open` slices).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.optim.adamw import BETA_POWS, MOMENTS, OptimizerSource, state_key
from flashcp.optim.zero import ShardArrays

SHARD_META = "flashcp_optimizer_shard"
"""safetensors metadata key of a shard file's segment map (JSON)."""


def shard_metadata(arrays: ShardArrays) -> dict[str, str]:
    """The safetensors metadata of a shard file: its segment map as JSON."""
    return {SHARD_META: json.dumps(arrays.segment_map(), sort_keys=True)}


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
        from safetensors import safe_open

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
