"""Hugging Face safetensors checkpoints: load into, and save from, flashcp models.

Parameter names already follow the HF layouts (GLM-4 ``Glm4ForCausalLM``, GLM-4.5
``Glm4MoeForCausalLM``; GPT uses flashcp's own names in the same style, see
`flashcp.models.gpt`), so a checkpoint key IS the Paddle structured name, e.g.
``model.layers.3.self_attn.q_proj.weight`` or ``model.layers.1.mlp.gate.e_score_correction_bias``.
The one difference is orientation: Paddle `Linear` (and the MoE router) store `[in, out]`,
HF `[out, in]`, so those weights are transposed on the way in and out.

`load_hf_checkpoint` reads a single ``.safetensors`` file or a directory holding either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, into a whole model
or ONE PIPELINE STAGE of it (its parameter names are the full model's): the module reads only
the tensors it holds — the index, the headers of the shards holding them, and each tensor's
own byte range (`flashcp.models.safetensors_io`, which counts every byte it reads) — so no
rank touches the weights of another stage. Keys of other stages (decoder layers it does not
hold; embeddings, which go with layer 0; final norm and head, which go with the last layer)
are left to their stage, which checks them. Every key, shape and dtype is checked from the
headers before any tensor is read; then each tensor is read, cast to the parameter's own
storage dtype (float32 or bfloat16: bf16 files fill bf16 parameters bit for bit) and
assigned. `on_tensor` / `read_hf_float32` give the file's float32 values for master weights.

Multi-token-prediction (MTP) layers (`flashcp.models.mtp`; GLM-4.5's
``num_nextn_predict_layers``) are decoder layers numbered from ``num_layers`` on,
``model.layers.{num_layers + d}.*``, with the names and orientations of any layer (their
``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head``
beside the block; routed experts per expert, only this ep rank's), and go with the last stage.
A model built with `ModelArgs.mtp_layers` needs them like any other tensor (missing ones are
named, with what to do); a checkpoint's MTP layers beyond the model's (e.g. a run with
``model.mtp_layers: 0`` from a GLM-4.5 directory) are skipped with a one-line note
(`MTP_SKIP_NOTE`). Also skipped, never errors: ``lm_head.weight`` when the embeddings are tied
and ``*.rotary_emb.inv_freq`` (old exports).

`save_hf_checkpoint` writes the same layout, MTP layers included (sharded above
`max_shard_bytes`), plus the HF ``config.json`` (`flashcp.models.hf_config.hf_config`, with
``num_nextn_predict_layers``); `args_from_hf_config` reads it, or a transformers-written one,
back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from paddle import nn
from safetensors.paddle import save_file

from flashcp.log import log_once
from flashcp.models.config import ModelArgs
from flashcp.models.hf_config import (  # noqa: F401 - re-exported
    ARGS_KEY,
    CONFIG_FILE,
    HFConfigError,
    args_from_hf_config,
    hf_config,
)
from flashcp.models.hf_mtp import missing_mtp_layers, mtp_layers_in
from flashcp.models.moe import TopkRouter
from flashcp.models.safetensors_io import (
    RAW_DTYPES,
    CastError,
    ReadCounter,
    SafetensorsFile,
    TensorInfo,
    cast_raw,
    to_float32,
)
from flashcp.models.weight_files import (  # noqa: F401 - re-exported
    INDEX_FILE,
    SINGLE_FILE,
    locate,
)

_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.")
_SHOW = 12  # keys listed per kind of error
_FIRST_STAGE = ("model.embed_tokens.", "model.embed_positions.")  # held with layer 0
_LAST_STAGE = ("model.norm.", "lm_head.")  # held with the last layer
MTP_SKIP_NOTE = (
    "{source}: skipped its multi-token-prediction layers {layers}: model.mtp_layers is "
    "{count} (set it to the checkpoint's num_nextn_predict_layers to keep and export them)"
)
"""One line when a load skips the checkpoint's MTP layers the model does not build."""


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not fit the model."""


@dataclass(frozen=True)
class HFEntry:
    """One checkpoint key: the model tensor it fills (all of it, or one expert's piece of a
    stacked expert weight) and whether HF stores it transposed.

    A piece is ``tensor[expert][:, columns[0]:columns[1]]`` in the Paddle layout (`[in, out]`,
    columns = output features); `name` is the state-dict name of `tensor`. `stored`: the shape
    the checkpoint keeps it in when that is another view of the same elements (a family's
    `flashcp.models.families.hf.Rename`, e.g. ERNIE-4.5's `[1, E]` correction bias).
    """

    key: str
    tensor: paddle.Tensor
    transposed: bool
    name: str = ""
    expert: int | None = None
    columns: tuple[int, int] | None = None
    stored: tuple[int, ...] | None = None

    @property
    def is_piece(self) -> bool:
        return self.expert is not None

    @property
    def shape(self) -> list[int]:
        """The Paddle-layout shape of what this key fills."""
        shape = [int(s) for s in self.tensor.shape]
        if self.expert is None:
            return shape
        shape = shape[1:]
        if self.columns is not None:
            shape[-1] = self.columns[1] - self.columns[0]
        return shape

    @property
    def hf_shape(self) -> list[int]:
        if self.stored is not None:
            return list(self.stored)
        shape = self.shape
        return shape[::-1] if self.transposed else shape

    def value(self) -> paddle.Tensor:
        """What this key fills, in the Paddle layout (a copy for a piece)."""
        if self.expert is None:
            return self.tensor
        t = self.tensor[self.expert]
        if self.columns is not None:
            t = t[:, self.columns[0] : self.columns[1]]
        return t

    def hf_array(self) -> np.ndarray:
        """This key's values as HF stores them (transposed back if need be), numpy."""
        with paddle.no_grad():
            t = self.value().detach()
            out = (t.transpose([1, 0]) if self.transposed else t).contiguous().numpy()
            return out.reshape(self.stored) if self.stored is not None else out

    @paddle.no_grad()
    def assign(self, value: paddle.Tensor) -> None:
        """Write `value` (Paddle layout, the tensor's dtype) into what this key fills."""
        if self.expert is None:
            paddle.assign(value, output=self.tensor)
        elif self.columns is None:
            self.tensor[self.expert] = value
        else:
            self.tensor[self.expert, :, self.columns[0] : self.columns[1]] = value


def _expert_pieces(prefix: str, layer: nn.Layer, state: Mapping[str, Any]) -> list[HFEntry]:
    """The per-expert HF keys of a stacked-experts layer (`flashcp.models.experts`): expert
    `first_expert + e`'s ``gate_proj`` / ``up_proj`` are the two column halves of
    ``gate_up_proj[e]``, its ``down_proj`` is ``down_proj[e]``; all HF `[out, in]`."""
    inter = int(layer.intermediate_size)
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    out = []
    for e in range(int(layer.num_experts)):
        key = f"{prefix}.{int(layer.first_expert) + e}"
        out += [
            HFEntry(f"{key}.gate_proj.weight", state[gate_up], True, gate_up, e, (0, inter)),
            HFEntry(f"{key}.up_proj.weight", state[gate_up], True, gate_up, e, (inter, 2 * inter)),
            HFEntry(f"{key}.down_proj.weight", state[down], True, down, e, None),
        ]
    return out


def hf_state_map(model: nn.Layer) -> dict[str, HFEntry]:
    """Checkpoint key → `HFEntry` for every parameter and persistent buffer of `model`; a
    stacked-experts layer's two weights become their per-expert HF keys (`_expert_pieces`);
    the family's renamed tensors take their checkpoint names and shapes
    (`flashcp.models.families.hf.HFSide.renames`)."""
    state = model.state_dict()
    args = getattr(model, "args", None)
    hf = args.family.hf if isinstance(args, ModelArgs) else None
    renames = hf.renames if hf is not None else ()
    transposed = set()
    entries: dict[str, HFEntry] = {}
    stacked: set[str] = set()
    for name, layer in model.named_sublayers():
        if isinstance(layer, (nn.Linear, TopkRouter)):
            transposed.add(f"{name}.weight")
        if getattr(layer, "STACKED_EXPERTS", False):
            for entry in _expert_pieces(name, layer, state):
                entries[entry.key] = entry
                stacked.add(entry.name)
    for name, tensor in state.items():
        if name in stacked:
            continue
        key, stored = name, None
        for r in renames:
            if name.endswith(r.ours):
                key = name[: -len(r.ours)] + r.theirs
                shape = [int(d) for d in tensor.shape]
                stored = tuple(r.stored(shape)) if r.stored is not None else None
                break
        entries[key] = HFEntry(key, tensor, name in transposed, name, stored=stored)
    return entries


# ------------------------------------------------------------------------------- loading


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


@dataclass
class _Checkpoint:
    """Key → file of a checkpoint, and its files opened so far (headers parsed)."""

    source: str
    key_files: dict[str, Path]
    files: list[Path]
    opened: dict[Path, SafetensorsFile]
    index: Path | None = None


def _open_checkpoint(path: str | os.PathLike[str], counter: ReadCounter) -> _Checkpoint:
    """A file, a single-file directory or a sharded directory (only the index is read:
    `flashcp.models.weight_files.locate`)."""
    found = locate(path, counter)
    opened = {found.files[0]: found.single} if found.single is not None else {}
    return _Checkpoint(found.path, found.key_files, found.files, opened, found.index)


def index_problems(
    path: str | os.PathLike[str], args: ModelArgs
) -> list[tuple[str, str, dict[str, Any]]]:
    """What the checkpoint at `path` lacks for a model of `args`, from its index (or its single
    file's header) alone, no tensor read: the embeddings, every decoder layer and every MTP
    layer `args` builds must have tensors there. Each problem is (config key, what is wrong,
    the change that fixes it, or {}). (A `model.from_pretrained` directory whose config.json
    declares MTP layers its weights lack is refused by the config's own check,
    `hf_mtp.mtp_refusal`; this covers `checkpoint.init_from`, with the same rule,
    `hf_mtp.missing_mtp_layers`.) A checkpoint that cannot be opened raises as
    `load_hf_checkpoint`."""
    ckpt = _open_checkpoint(path, ReadCounter())
    where = ckpt.index or ckpt.files[0]
    keys = list(ckpt.key_files)
    layers = {int(m.group(1)) for k in keys if (m := _LAYER_RE.match(k))}
    problems: list[tuple[str, str, dict[str, Any]]] = []
    missing = [i for i in range(args.num_layers) if i not in layers]
    if missing or not any(k.startswith("model.embed_tokens.") for k in keys):
        what = f"decoder layers {_ranges(missing)}" if missing else "model.embed_tokens"
        problems.append((
            "checkpoint.init_from",
            f"{where} has no tensors of {what} (model.num_layers {args.num_layers}): it is not a "
            "complete checkpoint of this model; download the missing shards or point at the "
            "complete directory",
            {},
        ))  # fmt: skip
    absent = missing_mtp_layers(keys, args.num_layers, args.mtp_layers)
    if absent:
        problems.append((
            "model.mtp_layers",
            f"{args.mtp_layers} multi-token-prediction layer(s) are built (model.mtp_layers), "
            f"but {where} holds no tensor of model.layers.{absent[0]}.* (MTP layer "
            f"{_ranges(absent)} is absent)",
            {"model.mtp_layers": absent[0] - args.num_layers},
        ))  # fmt: skip
    return problems


def _ranges(values: list[int]) -> str:
    """`3`, `3-5`, `3-5, 9`: sorted integers as ranges."""
    spans: list[list[int]] = []
    for v in sorted(values):
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _skippable(key: str, args: ModelArgs, extra_mtp: Collection[int]) -> bool:
    """Ignored on purpose: old ``inv_freq`` buffers, a tied head's copy, keys the family's
    reference class never reads (`HFSide.unread`), and the keys of the checkpoint's MTP layers
    the model does not build (`extra_mtp`)."""
    if key.endswith("rotary_emb.inv_freq"):
        return True
    if key == "lm_head.weight" and args.tie_embeddings:
        return True
    hf = args.family.hf
    if hf is not None and any(re.search(pattern, key) for pattern in hf.unread):
        return True
    m = _LAYER_RE.match(key)
    return m is not None and int(m.group(1)) in extra_mtp


def held_experts(module: nn.Layer) -> dict[str, tuple[range, int]]:
    """Stacked-experts layer name → (the experts it holds, its layer's experts in all)."""
    out = {}
    for name, layer in module.named_sublayers():
        if getattr(layer, "STACKED_EXPERTS", False):
            first, count = int(layer.first_expert), int(layer.num_experts)
            total = int(getattr(layer, "total_experts", count))
            out[name] = (range(first, first + count), total)
    return out


def _foreign(
    key: str, args: ModelArgs, held: set[int], experts: Mapping[str, tuple[range, int]]
) -> bool:
    """Whether `key` belongs to another pipeline stage than the module holding layers `held`,
    or to routed experts another ep rank holds (`experts`: `held_experts`).

    Stages split the decoder layers; the embeddings go with layer 0 and the final norm, head
    and MTP layers with the last layer (`flashcp.pipeline.stage`). The whole model holds
    every layer, so nothing is foreign to it.
    """
    e = _EXPERT_RE.match(key)
    if e is not None and e.group(1) in experts:
        mine, total = experts[e.group(1)]
        return int(e.group(2)) < total and int(e.group(2)) not in mine
    m = _LAYER_RE.match(key)
    if m is not None:
        index = int(m.group(1))
        if index < args.num_layers:
            return index not in held
        if mtp_depth(key, args) is not None:  # the last stage's
            return args.num_layers - 1 not in held
        return False
    if key.startswith(_FIRST_STAGE):
        return 0 not in held
    if key.startswith(_LAST_STAGE):
        return args.num_layers - 1 not in held
    return False


def mtp_depth(key: str, args: ModelArgs) -> int | None:
    """The MTP depth (0-based) of the model's MTP layer `key` belongs to; None for other keys."""
    m = _LAYER_RE.match(key)
    if m is None or not args.num_layers <= int(m.group(1)) < args.num_layers + args.mtp_layers:
        return None
    return int(m.group(1)) - args.num_layers


def _listing(title: str, items: list[str], hint: str = "") -> str:
    shown = "\n".join(f"    {s}" for s in items[:_SHOW])
    more = f"\n    ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"  {title} ({len(items)}){hint}:\n{shown}{more}"


def _headline(
    missing: list[str],
    mtp_missing: list[str],
    absent: list[str],
    unexpected: list[str],
    mismatched: list[str],
    uncastable: list[str],
    args: ModelArgs,
) -> str:
    """The first line of a `CheckpointMismatchError`: each kind of problem counted, with the
    fix where one setting is it — what a failure summary that keeps one line shows."""
    parts = []
    if len(missing) > len(mtp_missing):
        parts.append(f"{len(missing) - len(mtp_missing)} tensors missing")
    if mtp_missing:
        held = min(int(mtp_depth(k, args) or 0) for k in mtp_missing)
        parts.append(
            f"{len(mtp_missing)} multi-token-prediction tensors missing (set "
            f"model.mtp_layers={held} to train without the layers it lacks)"
        )
    for items, what in (
        (absent, "listed in the index but not in their shard"),
        (unexpected, "unexpected"),
        (mismatched, "of another shape"),
        (uncastable, "of a dtype that cannot be loaded"),
    ):
        if items:
            parts.append(f"{len(items)} {what}")
    return "; ".join(parts) + " (listed below)"


def _dtype_name(tensor: paddle.Tensor) -> str:
    return str(tensor.dtype).replace("paddle.", "")


def _plan(
    module: nn.Layer,
    ckpt: _Checkpoint,
    counter: ReadCounter,
    report: LoadReport,
    strict: bool,
    names: Collection[str] | None,
) -> dict[Path, list[tuple[HFEntry, TensorInfo]]]:
    """Check every key, shape and dtype this module needs; file → what to read from it.

    `names`: only these of the module's tensors (None: all). Reads the index (done) and the
    headers of the files holding the tensors to read, no tensor data. Raises
    `CheckpointMismatchError` listing every problem.
    """
    args: ModelArgs = module.args  # type: ignore[attr-defined]
    held_entries = hf_state_map(module)
    held = {int(m.group(1)) for k in held_entries if (m := _LAYER_RE.match(k))}
    experts = held_experts(module)
    entries = held_entries
    if names is not None:
        unknown = sorted(set(names) - set(held_entries))
        if unknown:
            raise KeyError(f"not tensors of this module: {unknown[:_SHOW]}")
        entries = {k: held_entries[k] for k in names}
    missing = sorted(set(entries) - set(ckpt.key_files))
    built = args.num_layers + args.mtp_layers
    extra_mtp = {i for i in mtp_layers_in(ckpt.key_files, args.num_layers) if i >= built}
    report.skipped_mtp = sorted(extra_mtp)
    unexpected: list[str] = []
    for key in sorted(set(ckpt.key_files) - set(held_entries)):
        if _skippable(key, args, extra_mtp):
            report.skipped.append(key)
        elif _foreign(key, args, held, experts):
            report.foreign.append(key)
        else:
            unexpected.append(key)
    plan: dict[Path, list[tuple[HFEntry, TensorInfo]]] = {}
    absent, mismatched, uncastable = [], [], []
    for key in sorted(set(entries) & set(ckpt.key_files)):
        f = ckpt.key_files[key]
        if f not in ckpt.opened:
            ckpt.opened[f] = SafetensorsFile(f, counter)
        info = ckpt.opened[f].tensors.get(key)
        entry = entries[key]
        if info is None:
            absent.append(f"{key}: not in {f.name}")
            continue
        if list(info.shape) != entry.hf_shape:
            layout = " (HF [out, in] layout)" if entry.transposed else ""
            mismatched.append(
                f"{key}: checkpoint {list(info.shape)} vs model {entry.hf_shape}{layout} "
                f"in {f.name}"
            )
            continue
        try:
            cast_raw(np.empty(0, RAW_DTYPES[info.dtype]), info.dtype, _dtype_name(entry.tensor))
        except CastError as exc:
            uncastable.append(f"{key} in {f.name}: {exc}")
            continue
        plan.setdefault(f, []).append((entry, info))
    problems = []
    mtp_missing = [k for k in missing if mtp_depth(k, args) is not None]
    if len(mtp_missing) < len(missing):
        problems.append(
            _listing(
                "missing from the checkpoint",
                [k for k in missing if mtp_depth(k, args) is None],
                " [this module needs them: is checkpoint.init_from a checkpoint of this model "
                "(arch, layers, sizes in its config.json)?]",
            )
        )
    if mtp_missing:
        problems.append(
            _listing(
                "multi-token-prediction (MTP) weights missing from the checkpoint",
                mtp_missing,
                f" [model.mtp_layers is {args.mtp_layers} (config.json "
                "num_nextn_predict_layers): use a checkpoint that holds these MTP layers, or "
                "set model.mtp_layers to the number it holds (0: none)]",
            )
        )
    if absent:
        problems.append(
            _listing("listed in the index but not in their shard", absent, " [re-download]")
        )
    if unexpected and strict:
        problems.append(
            _listing("unexpected in the checkpoint", unexpected, " [strict=False skips them]")
        )
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched))
    if uncastable:
        problems.append(
            _listing(
                "dtypes that cannot be loaded",
                uncastable,
                " [floating parameters take F32/BF16/F16/F64: convert the checkpoint]",
            )
        )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.source} does not fit the {args.arch} model: "
            + _headline(missing, mtp_missing, absent, unexpected if strict else [], mismatched,
                        uncastable, args)  # fmt: skip
            + "\n"
            + "\n".join(problems)
        )
    report.skipped.extend(unexpected)
    return plan


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
    ckpt = _open_checkpoint(path, counter)
    try:
        plan = _plan(module, ckpt, counter, report, strict, names)
        for f in sorted(plan):
            for entry, info in plan[f]:
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
            value = cast_raw(raw, info.dtype, _dtype_name(entry.tensor))
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


# -------------------------------------------------------------------------------- saving


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _nbytes(t: paddle.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def save_hf_checkpoint(
    model: nn.Layer,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
    dtype: str | None = None,
) -> list[Path]:
    """Write `model` as HF-layout safetensors (+ `config.json`) into `directory`.

    One ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json`` when the total exceeds `max_shard_bytes`. `dtype`
    casts every tensor (default: keep each tensor's dtype). Files are written to temporary
    names and renamed, and model weight files of an earlier save that this one did not
    rewrite are removed, so a loader never mixes two saves. Returns the weight files.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, paddle.Tensor] = {}
    for key, entry in hf_state_map(model).items():
        t = entry.value().detach()
        if entry.transposed:
            t = t.transpose([1, 0])
        if entry.stored is not None:
            t = t.reshape(list(entry.stored))
        if dtype is not None:
            t = t.astype(dtype)
        tensors[key] = t.cpu().contiguous()
    shards: list[dict[str, paddle.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        n = _nbytes(tensors[key])
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += n
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = []
    for name, shard in zip(names, shards, strict=True):
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        written.append(out / name)
    if len(shards) > 1:
        weight_map = {k: n for n, shard in zip(names, shards, strict=True) for k in shard}
        total = sum(_nbytes(t) for t in tensors.values())
        _atomic_json(
            out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    for stale in out.iterdir():
        is_weights = stale.name == SINGLE_FILE or _SHARD_RE.match(stale.name)
        if (is_weights and stale not in written) or (stale.name == INDEX_FILE and len(shards) == 1):
            stale.unlink()
    saved_dtype = dtype or str(next(iter(tensors.values())).dtype).replace("paddle.", "")
    _atomic_json(out / CONFIG_FILE, hf_config(model.args, saved_dtype))  # type: ignore[attr-defined]
    return written
