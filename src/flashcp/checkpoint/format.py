"""Atomic, checksummed checkpoints: safetensors for tensors, JSON for trainer state.

Layout of `<output_dir>/checkpoints/step_<N>/`:

* `model.safetensors`     parameters by structured name (`model.layers.0.self_attn.q_proj.weight`)
* `optimizer.safetensors` AdamW accumulators as `<parameter name>::<accumulator>` (moments,
  beta powers), independent of Paddle's generated tensor names
* `trainer_state.json`    step, LR scheduler, data position, RNG states, config hash
* `manifest.json`         sha256 and size of each file above, written last

Pipeline stages, LoRA adapters and float32 master weights (bf16 storage, ZeRO-1) write the
model and optimizer in parts instead (`flashcp.checkpoint.parts` names them): the manifest's
`layout` lists them, and optimizer shards are handed to the optimizer as files
(`Checkpoint.optimizer_shards`).

A checkpoint is written into `step_N.tmp/`, every file fsynced, then renamed to `step_N/` (and
the parent directory fsynced; `publish`), so a crash never leaves a half-written `step_N/`.
`flashcp.checkpoint.saving` writes it (every rank its part, rank 0 the commit). Loading checks
the manifest first: a missing, truncated or altered file is refused with the reason, and
`latest_checkpoint` skips such checkpoints (with a warning) to resume from an older intact one.
Reading: `read_layout` (the manifest: which files hold what), then `load_checkpoint` (every
tensor, for resume) or `TensorReader` (one tensor at a time, for `flashcp export`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from flashcp.log import logger
from flashcp.rundir import CHECKPOINT_DIR as CHECKPOINT_DIR

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and why (`problems`)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass
class Checkpoint:
    """A loaded checkpoint."""

    path: Path
    step: int
    model: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: dict[str, Any]
    optimizer_shards: list[list[Path]] = field(default_factory=list)
    """Per pipeline stage, the ZeRO-1 optimizer shard files (read lazily by
    `flashcp.checkpoint.optimizer_state.ShardSource`); empty for unsharded checkpoints."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry: its sha256 and size."""
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    root: Path,
    tmp: Path,
    step: int,
    files: Mapping[str, Any],
    *,
    keep_last: int | None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checksum manifest into `tmp`, then atomically rename it to `step_N`.

    A step saved again swaps out the old directory first; `keep_last` then prunes. The one
    commit path of every checkpoint (`flashcp.checkpoint.saving.commit`).
    """
    manifest = {"format": FORMAT_VERSION, "step": step, "files": dict(files), **(extra or {})}
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    fsync_file(tmp / MANIFEST_FILE)
    _fsync_dir(tmp)
    final = step_dir(root, step)
    old = None
    if final.exists():  # re-saving a step (e.g. after a fresh start): swap, then drop the old
        old = root / f"step_{step}.old"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems of the checkpoint at `path` (empty when every file matches its manifest)."""
    p = Path(path)
    if not p.is_dir():
        return [f"{p} is not a directory"]
    manifest_path = p / MANIFEST_FILE
    if not manifest_path.is_file():
        return [f"{MANIFEST_FILE} is missing (the save did not finish)"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"{MANIFEST_FILE} is unreadable ({exc})"]
    problems = []
    for name in required_files(manifest):
        if name not in files:
            problems.append(f"{MANIFEST_FILE} does not list {name}")
            continue
        f = p / name
        if not f.is_file():
            problems.append(f"{name} is missing")
            continue
        size = f.stat().st_size
        if size != files[name]["bytes"]:
            problems.append(f"{name} has {size} bytes, the manifest says {files[name]['bytes']}"
                            " (truncated or overwritten)")  # fmt: skip
        elif _sha256(f) != files[name]["sha256"]:
            problems.append(f"{name} does not match its sha256 checksum (corrupted)")
    return problems


@dataclass(frozen=True)
class Layout:
    """Which files of a verified checkpoint hold what: its manifest's `layout` (parts written
    by several ranks, `flashcp.checkpoint.parts`) or the classic single files."""

    path: Path
    model: list[Path]
    optimizer: list[Path]
    optimizer_shards: list[list[Path]]
    """Per pipeline stage, the ZeRO-1 / master-weight optimizer shard files."""


def read_layout(path: str | Path) -> Layout:
    """Verify the checkpoint at `path` and read where its tensors are; `CheckpointError`
    naming every problem. The one reader of the manifest (`load_checkpoint` for resume, and
    `flashcp export`, which reads tensors one by one)."""
    p = Path(path)
    problems = verify_checkpoint(p)
    if problems:
        raise CheckpointError(
            f"checkpoint {p} is broken and was not loaded: " + "; ".join(problems), problems
        )
    layout = json.loads((p / MANIFEST_FILE).read_text()).get("layout")
    model_files = layout["model"] if layout else [MODEL_FILE]
    optimizer_files = layout["optimizer"] if layout else [OPTIMIZER_FILE]
    shards = layout.get("optimizer_shards", []) if layout else []
    return Layout(
        path=p,
        model=[p / name for name in model_files],
        optimizer=[p / name for name in optimizer_files],
        optimizer_shards=[[p / name for name in stage] for stage in shards],
    )


class TensorReader:
    """Single tensors by name from several safetensors files (headers parsed once, each tensor
    read when asked). A name in several files (the two pipeline stages' equal copies of a tied
    matrix) is read from the first."""

    def __init__(self, files: Sequence[Path], stack: contextlib.ExitStack) -> None:
        self.where: dict[str, Any] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="numpy"))
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                self.where.setdefault(key, handle)

    def names(self) -> list[str]:
        return list(self.where)

    def missing(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n not in self.where]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The tensors `names` (`KeyError` for one the files lack: check `missing` first)."""
        return {n: self.where[n].get_tensor(n) for n in names}


def read_tensors(files: Sequence[Path]) -> dict[str, np.ndarray]:
    """Every tensor of several safetensors files, as one dict (`TensorReader`)."""
    with contextlib.ExitStack() as stack:
        reader = TensorReader(files, stack)
        return reader.read(reader.names())


def load_checkpoint(path: str | Path, *, optimizer: bool = True) -> Checkpoint:
    """Verify, then read the checkpoint at `path`; `CheckpointError` naming every problem.
    `optimizer=False` leaves the optimizer state unread (`flashcp eval` needs the weights)."""
    layout = read_layout(path)
    state = json.loads((layout.path / STATE_FILE).read_text())
    return Checkpoint(
        path=layout.path,
        step=int(state["step"]),
        model=read_tensors(layout.model),
        optimizer=read_tensors(layout.optimizer) if optimizer else {},
        state=state,
        optimizer_shards=layout.optimizer_shards,
    )


def required_files(manifest: Mapping[str, Any]) -> list[str]:
    """Files a checkpoint must hold: the classic three, or (a checkpoint written in parts by
    several ranks, `flashcp.checkpoint.parts`) every file its manifest lists."""
    if manifest.get("layout"):
        return sorted(set(manifest["files"]) | {STATE_FILE})
    return [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """`(step, path)` of every `step_N` directory under `root`, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = []
    for entry in r.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: str | Path, *, warn: bool = True) -> Path | None:
    """The newest intact checkpoint under `root`; broken ones are skipped (with a warning)."""
    for step, path in reversed(list_checkpoints(root)):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        if warn:
            logger.warning(
                "skipping broken checkpoint %s (step %d): %s", path, step, "; ".join(problems)
            )
    return None


def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (and stale `.tmp`/`.old` dirs)."""
    r = Path(root)
    removed = []
    for entry in r.glob("step_*"):
        if entry.is_dir() and entry.name.endswith((".tmp", ".old")):
            shutil.rmtree(entry, ignore_errors=True)
    for _, path in list_checkpoints(r)[: -max(1, keep_last)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
