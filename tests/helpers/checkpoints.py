"""Checkpoints for tests, written by the trainer's own writer (`flashcp.checkpoint.saving`:
one rank's `write_part`, then rank 0's `commit`), so fixtures are exactly what a run writes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.checkpoint import saving
from flashcp.checkpoint.checkpointer import FORMAT_META
from flashcp.checkpoint.format import MODEL_FILE, OPTIMIZER_FILE, prune_checkpoints
from flashcp.checkpoint.parts import begin
from flashcp.checkpoint.saving import Commit, PartFile, Snapshot


def write_checkpoint(
    root: str | Path,
    step: int,
    files: Mapping[str, Mapping[str, np.ndarray]],
    *,
    state: Mapping[str, Any],
    layout: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    adapters: bool = False,
) -> Path:
    """Checkpoint `step` under `root` holding `files` (name → arrays; `layout` None: the
    one-writer layout), then pruned to `keep_last`. Returns its directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = begin(root, step, adapters=adapters)
    parts = [PartFile(name, arrays, FORMAT_META) for name, arrays in files.items()]
    report = saving.write_part(tmp, Snapshot(step, parts), 0)
    if report.error is not None:
        raise (RuntimeError if report.fatal else OSError)(report.error)
    spec = Commit(state=state, layout=layout, expected=list(files), keep_last=None)
    path = saving.commit(root, step, spec, [report])
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return path


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: Mapping[str, np.ndarray],
    optimizer: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
    keep_last: int | None = None,
) -> Path:
    """A one-writer checkpoint: `model.safetensors` and `optimizer.safetensors`."""
    return write_checkpoint(root, step, {MODEL_FILE: model, OPTIMIZER_FILE: optimizer},
                            state=state, keep_last=keep_last)  # fmt: skip


def save_stages(
    root: str | Path,
    step: int,
    models: Sequence[Mapping[str, np.ndarray]],
    optimizers: Sequence[Mapping[str, np.ndarray]],
    *,
    state: Mapping[str, Any],
    keep_last: int | None = None,
) -> Path:
    """A checkpoint in one model and one optimizer part per pipeline stage (the manifest's
    `layout` lists them, `flashcp.checkpoint.parts.part_names`)."""
    from flashcp.checkpoint.parts import part_names

    model_files, optimizer_files = part_names(len(models), adapters=False)
    files = {**dict(zip(model_files, models, strict=True)),
             **dict(zip(optimizer_files, optimizers, strict=True))}  # fmt: skip
    layout = {"model": model_files, "optimizer": optimizer_files}
    return write_checkpoint(root, step, files, state=state, layout=layout, keep_last=keep_last)
