"""Loading a Hugging Face safetensors checkpoint into a flashcp model, or into one pipeline
stage of it, reading only the bytes that stage holds.

`load_hf_checkpoint` reads a single ``.safetensors`` file or a directory holding either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, into a whole model
or ONE PIPELINE STAGE of it (its parameter names are the full model's): the module reads only
the tensors it holds — the index, the headers of the shards holding them, and each tensor's
own byte range (`flashcp.models.safetensors_io`, which counts every byte it reads) — so no
rank touches the weights of another stage. Which tensor each key fills, and in which
orientation, is `flashcp.models.hf_state`'s; every key, shape and dtype is checked from the
headers before any tensor is read (`flashcp.models.hf_check`: keys of other stages are left
to their stage, which checks them). Then each tensor is read, cast to the parameter's own
storage dtype (float32 or bfloat16: bf16 files fill bf16 parameters bit for bit) and
assigned. `on_tensor` / `read_hf_float32` give the file's float32 values for master weights.

Multi-token-prediction (MTP) layers (`flashcp.models.mtp`; GLM-4.5's
``num_nextn_predict_layers``) are decoder layers ``model.layers.{num_layers + d}.*`` (their
``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head``
beside the block; routed experts per expert, only this ep rank's), and go with the last stage.
A model built with `ModelArgs.mtp_layers` needs them like any other tensor (missing ones are
named, with what to do); a checkpoint's MTP layers beyond the model's (e.g. a run with
``model.mtp_layers: 0`` from a GLM-4.5 directory) are skipped with a one-line note
(`MTP_SKIP_NOTE`). Also skipped, never errors: ``lm_head.weight`` when the embeddings are tied
and ``*.rotary_emb.inv_freq`` (old exports). Writing the same layout is
`flashcp.models.hf_save`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import paddle
from paddle import nn

from flashcp.log import log_once
from flashcp.models.hf_check import check_fit, dtype_name, open_checkpoint
from flashcp.models.hf_state import HFEntry, hf_state_map
from flashcp.models.safetensors_io import ReadCounter, TensorInfo, cast_raw, to_float32

MTP_SKIP_NOTE = (
    "{source}: skipped its multi-token-prediction layers {layers}: model.mtp_layers is "
    "{count} (set it to the checkpoint's num_nextn_predict_layers to keep and export them)"
)
"""One line when a load skips the checkpoint's MTP layers the model does not build."""


class Float32Source:
    """The checkpoint's own values of one tensor, in the Paddle layout, as float32 on demand.

    Handed to `load_hf_checkpoint`'s `on_tensor` callback so float32 master weights can be
    filled from the file's values rather than from parameters rounded to bf16. Valid only
    during the callback (it holds the tensor's raw bytes as read, nothing converted yet). For
    a per-expert key of a stacked expert weight it is that expert's piece (`HFEntry`).
    """

    def __init__(self, raw: np.ndarray, code: str, transposed: bool) -> None:
        self._raw, self._code, self._transposed = raw, code, transposed
        self.shape = list(raw.shape[::-1] if transposed else raw.shape)
        """Shape in the Paddle layout (`[in, out]` for a Linear weight)."""
        self.size = int(raw.size)

    def float32(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements `[start, stop)` of the row-major flattened Paddle-layout tensor, float32.

        Converts only the rows the slice covers (a new array; exact for F32/BF16/F16 files).
        """
        stop = self.size if stop is None else stop
        if not 0 <= start <= stop <= self.size:
            raise IndexError(f"slice [{start}, {stop}) is outside a tensor of {self.size}")
        if not self._transposed or self._raw.ndim != 2:
            return to_float32(self._raw.reshape(-1)[start:stop], self._code).copy()
        cols = self.shape[1]
        first, last = start // cols, -(-stop // cols)
        rows = np.ascontiguousarray(self._raw.T[first:last]).reshape(-1)
        offset = first * cols
        return to_float32(rows[start - offset : stop - offset], self._code).copy()


OnTensor = Callable[[str, Float32Source], None]


@dataclass
class LoadReport:
    """What `load_hf_checkpoint` did, and the bytes it read (measured at the read calls)."""

    files: list[str]
    """Weight files this load opened (read a header and tensors from)."""
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Keys ignored on purpose (tied head, inv_freq, MTP layers the model does not build,
    unexpected with strict=False)."""
    skipped_mtp: list[int] = field(default_factory=list)
    """The checkpoint's MTP layers (global indices) skipped because the model builds fewer
    (`ModelArgs.mtp_layers`); their keys are in `skipped`."""
    foreign: list[str] = field(default_factory=list)
    """Keys of other pipeline stages (or other ep ranks' experts): neither read nor checked
    here (their stage / ep rank checks them)."""
    bytes_read: int = 0
    """Every byte read from the checkpoint: index, headers and tensor data."""
    bytes_by_file: dict[str, int] = field(default_factory=dict)
    share_bytes: int = 0
    """Sum of the file sizes (nbytes) of the loaded tensors: this module's share."""


def _read_tensors(
    module: nn.Layer,
    path: str | os.PathLike[str],
    report: LoadReport,
    *,
    strict: bool,
    names: Collection[str] | None = None,
) -> Iterator[tuple[HFEntry, TensorInfo, np.ndarray]]:
    """Check, then yield (entry, header info, raw file data) of each tensor to load.

    Fills `report` as it goes; the byte counts once the generator is finished or closed.
    """
    counter = ReadCounter()
    ckpt = open_checkpoint(path, counter)
    try:
        fit = check_fit(module, ckpt, counter, strict, names)
        report.skipped_mtp = fit.skipped_mtp
        report.skipped.extend(fit.skipped)
        report.foreign.extend(fit.foreign)
        for f in sorted(fit.reads):
            for entry, info in fit.reads[f]:
                yield entry, info, ckpt.opened[f].read(info.key)
                report.loaded.append(info.key)
                report.share_bytes += info.nbytes
    finally:
        for handle in ckpt.opened.values():
            handle.close()
        report.files = [str(f) for f in sorted(ckpt.opened)]
        report.bytes_read = counter.total
        report.bytes_by_file = dict(counter.by_file)


def load_hf_checkpoint(
    module: nn.Layer,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    on_tensor: OnTensor | None = None,
) -> LoadReport:
    """Fill `module` from an HF-layout safetensors checkpoint (file, directory or shards).

    `module` is a whole `CausalLM` or one pipeline stage of it (parameter names are the full
    model's): it reads only the tensors it holds, from the files holding them, each tensor's
    byte range alone, cast on read to the tensor's own dtype (`cast_raw`: a bf16 file fills
    bf16 parameters bit for bit, float32 rounds to nearest even into bf16, bf16 widens
    exactly into float32). Keys of other stages are left alone (`LoadReport.foreign`).

    Before reading any tensor data it raises `CheckpointMismatchError` naming every missing
    key, unexpected key (only when `strict`), shape mismatch (key, file, checkpoint shape,
    model shape) and uncastable dtype, so a bad checkpoint leaves the module untouched.

    `on_tensor(key, source)` is called after each tensor is assigned, with its checkpoint key
    (the state-dict name, except for the per-expert keys of stacked expert weights) and a
    `Float32Source` of the file's values (e.g. to fill float32 master weights, or just
    this rank's flat slice of them, without a bf16 round trip and without a second read).
    """
    report = LoadReport(files=[])
    with contextlib.closing(_read_tensors(module, path, report, strict=strict)) as tensors:
        for entry, info, raw in tensors:
            value = cast_raw(raw, info.dtype, dtype_name(entry.tensor))
            tensor = paddle.to_tensor(np.ascontiguousarray(value), place=entry.tensor.place)
            if tensor.dtype != entry.tensor.dtype:  # numpy has no bf16: uint16 → bf16
                raise AssertionError(f"{info.key}: {tensor.dtype} != {entry.tensor.dtype}")
            if entry.transposed:  # on the device (Paddle's kernel beats numpy's strided copy)
                tensor = tensor.transpose([1, 0]).contiguous()
            if entry.stored is not None:  # another view of the same elements
                tensor = tensor.reshape(entry.shape)
            entry.assign(tensor)
            del tensor, value
            if on_tensor is not None:
                on_tensor(info.key, Float32Source(raw, info.dtype, entry.transposed))
    _note_skipped_mtp(module, path, report)
    return report


def _note_skipped_mtp(module: nn.Layer, path: str | os.PathLike[str], report: LoadReport) -> None:
    """Say once per process and checkpoint that its extra MTP layers were skipped."""
    if report.skipped_mtp:
        layers = ", ".join(f"model.layers.{i}" for i in report.skipped_mtp)
        count = module.args.mtp_layers  # type: ignore[attr-defined]
        note = MTP_SKIP_NOTE.format(source=path, layers=layers, count=count)
        log_once(f"mtp-skip:{path}", note)


def read_hf_float32(
    module: nn.Layer,
    path: str | os.PathLike[str],
    slices: Mapping[str, tuple[int, int]],
) -> tuple[dict[str, np.ndarray], LoadReport]:
    """The checkpoint's float32 values of flat slices of some of `module`'s tensors.

    `slices[name] = (start, stop)` over the row-major flattened Paddle-layout tensor `name`
    (a state-dict name; e.g. this rank's ZeRO shard of the float32 master weights, filled from
    the file rather than from bf16 parameters). Only the checkpoint keys of the named tensors
    are read, each whole — for a stacked expert weight only the experts the slice touches (a
    flat shard cuts at most two tensors partially); keys, shapes and dtypes are checked as in
    `load_hf_checkpoint`; nothing is assigned. Returns the slices and the `LoadReport`.
    """
    held = hf_state_map(module)
    keys: list[str] = []
    for name, (start, stop) in slices.items():
        mine = [e for e in held.values() if e.name == name]
        if not mine:
            raise KeyError(f"not tensors of this module: {[name]}")
        for entry in mine:
            if entry.is_piece:
                size = int(np.prod(entry.tensor.shape[1:]))
                lo, hi = entry.expert * size, (entry.expert + 1) * size  # type: ignore[operator]
                if hi <= start or lo >= stop:
                    continue
            keys.append(entry.key)
    report = LoadReport(files=[])
    out = {name: np.empty(stop - start, dtype=np.float32) for name, (start, stop) in slices.items()}
    blocks: dict[tuple[str, int], tuple[np.ndarray, int]] = {}  # experts being assembled
    reader = _read_tensors(module, path, report, strict=True, names=keys)
    with contextlib.closing(reader) as tensors:
        for entry, info, raw in tensors:
            source = Float32Source(raw, info.dtype, entry.transposed)
            start, stop = slices[entry.name]
            if not entry.is_piece:
                out[entry.name][:] = source.float32(start, stop)
                continue
            shape = [int(d) for d in entry.tensor.shape[1:]]
            key = (entry.name, int(entry.expert))  # type: ignore[arg-type]
            block, filled = blocks.get(key, (np.empty(shape, np.float32), 0))
            c0, c1 = entry.columns or (0, shape[-1])
            block[:, c0:c1] = source.float32().reshape(source.shape)
            filled += c1 - c0
            if filled < shape[-1]:
                blocks[key] = (block, filled)
                continue
            blocks.pop(key, None)
            size = block.size
            lo = max(start, key[1] * size)
            hi = min(stop, (key[1] + 1) * size)
            out[entry.name][lo - start : hi - start] = block.reshape(-1)[
                lo - key[1] * size : hi - key[1] * size
            ]
    return out, report
