"""Optimizer state in checkpoints, whatever layout wrote it and whatever layout reads it.

Two saved forms:

* unsharded (`flashcp.checkpoint.state.optimizer_arrays`): `<name>::moment1_0`, `::moment2_0`,
  `::beta1_pow_acc_0`, `::beta2_pow_acc_0` arrays of the full parameter shapes; the float32
  parameters themselves are the master weights;
* shards (`flashcp.optim.zero`, one file per rank of a stage): packed float32 arrays
  `master`, `moment1`, `moment2` (the rank's segments back to back) and `beta1_pow`,
  `beta2_pow` (one entry per segment), with the segment map `[name, start, length, offset]` in
  the safetensors metadata (`SHARD_META`): the segment holds elements `[start, start + length)`
  of the flattened parameter `name`, at `offset` in the packed arrays.

`OptimizerSource` reads either form by (parameter, element range), so a checkpoint written by
one dp × cp (or unsharded) loads into any other: `ClassicSource` slices the full arrays,
`ShardSource` stitches a range together from the pieces of several shard files, reading only
those bytes (`safetensors.safe_open` slices).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

SEP = "::"
SHARD_META = "flashcp_optimizer_shard"
"""safetensors metadata key of a shard file's segment map (JSON)."""
ARRAYS = ("master", "moment1", "moment2", "beta1_pow", "beta2_pow")
CLASSIC = {"moment1": "moment1_0", "moment2": "moment2_0"}
BETAS = ("beta1_pow_acc_0", "beta2_pow_acc_0")


def fresh_betas(beta1: float, beta2: float) -> tuple[np.ndarray, np.ndarray]:
    """Paddle's AdamW beta-power accumulators before the first step."""
    return np.array([beta1], np.float32), np.array([beta2], np.float32)


@dataclass
class ShardArrays:
    """One shard's state as written to its file (see the module docstring)."""

    segments: list[tuple[str, int, int, int]]
    numel: dict[str, int]
    shards: int
    index: int
    master: np.ndarray
    moment1: np.ndarray
    moment2: np.ndarray
    beta1_pow: np.ndarray
    beta2_pow: np.ndarray

    def tensors(self) -> dict[str, np.ndarray]:
        return {k: np.ascontiguousarray(getattr(self, k), dtype=np.float32) for k in ARRAYS}

    def metadata(self) -> dict[str, str]:
        meta = {
            "segments": [list(s) for s in self.segments],
            "numel": self.numel,
            "shards": self.shards,
            "index": self.index,
        }
        return {SHARD_META: json.dumps(meta, sort_keys=True)}


class OptimizerSource(Protocol):
    """Saved optimizer state, read by parameter name and element range."""

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        """Elements `[start, start + length)` of the flattened `kind` ("master", "moment1",
        "moment2") of parameter `name`, float32; None when the checkpoint has none."""
        ...

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The parameter's AdamW beta-power accumulators (shape [1] each), or None."""
        ...

    def classic(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        """The unsharded form (`<name>::<accumulator>`) for the parameters in `shapes`."""
        ...


class ClassicSource:
    """The unsharded form (a dict of `<name>::<accumulator>` arrays)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        if kind not in CLASSIC:
            return None  # the float32 parameters are the masters
        value = self.arrays.get(f"{name}{SEP}{CLASSIC[kind]}")
        if value is None:
            return None
        flat = value.reshape(-1)
        if start + length > flat.size:
            raise ValueError(
                f"checkpoint state {name}{SEP}{CLASSIC[kind]} has {flat.size} elements, the "
                f"model's parameter at least {start + length} (saved with another model config?)"
            )
        return np.asarray(flat[start : start + length], dtype=np.float32)

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        pair = [self.arrays.get(f"{name}{SEP}{b}") for b in BETAS]
        if pair[0] is None or pair[1] is None:
            return None
        return pair[0].reshape(1), pair[1].reshape(1)

    def classic(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        return self.arrays


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
        h = self.files[f]
        return (
            np.asarray(h.get_slice("beta1_pow")[i : i + 1], np.float32),
            np.asarray(h.get_slice("beta2_pow")[i : i + 1], np.float32),
        )

    def classic(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            if name not in self.pieces:
                continue
            n = int(np.prod(shape)) if len(shape) else 1
            for kind, acc in CLASSIC.items():
                value = self.read(name, kind, 0, n)
                assert value is not None
                out[f"{name}{SEP}{acc}"] = value.reshape(list(shape))
            betas = self.beta_pows(name)
            assert betas is not None
            for acc, value in zip(BETAS, betas, strict=True):
                out[f"{name}{SEP}{acc}"] = value
        return out


def source_for(
    classic: Mapping[str, np.ndarray], shard_files: Sequence[Sequence[str | Path]]
) -> OptimizerSource:
    """The source of a loaded checkpoint: its shard files (per stage) if it has any, else its
    unsharded arrays."""
    if any(shard_files):
        return ShardSource(shard_files)
    return ClassicSource(classic)
