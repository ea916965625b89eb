"""Whether a Hugging Face checkpoint fits a model, or one pipeline stage of it, before any
tensor is read: the checks `flashcp.models.hf_load` runs first and the preflight runs alone.

`check_fit` compares the module's tensors (`flashcp.models.hf_state.hf_state_map`) with the
checkpoint's index and the headers of the files holding them: every key, shape and dtype, so
a bad checkpoint raises `CheckpointMismatchError` — each kind of problem counted on the first
line with its fix, every key listed below — and leaves the module untouched. It sorts the
checkpoint's other keys into three kinds: skipped on purpose (old ``inv_freq`` buffers, a
tied head's copy, keys the family's reference class never reads, the checkpoint's MTP layers
the model does not build), foreign (another pipeline stage's layers, another ep rank's
experts: their stage checks them) and unexpected (refused when strict). `index_problems` is
the lighter check of the launch's preflight (`checkpoint.init_from`): from the index alone,
whether the checkpoint holds every decoder and MTP layer the model builds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paddle
from paddle import nn

from flashcp.models.config import ModelArgs
from flashcp.models.hf_mtp import missing_mtp_layers, mtp_depth, mtp_layers_in
from flashcp.models.hf_state import HFEntry, held_experts, hf_state_map
from flashcp.models.safetensors_io import (
    RAW_DTYPES,
    CastError,
    ReadCounter,
    SafetensorsFile,
    TensorInfo,
    cast_raw,
)
from flashcp.models.weight_files import locate
from flashcp.problems import Problem, as_fix

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.")
_SHOW = 12  # keys listed per kind of error
_FIRST_STAGE = ("model.embed_tokens.", "model.embed_positions.")  # held with layer 0
_LAST_STAGE = ("model.norm.", "lm_head.")  # held with the last layer


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not fit the model."""


@dataclass
class OpenCheckpoint:
    """Key → file of a checkpoint, and its files opened so far (headers parsed)."""

    source: str
    key_files: dict[str, Path]
    files: list[Path]
    opened: dict[Path, SafetensorsFile]
    index: Path | None = None


def open_checkpoint(path: str | os.PathLike[str], counter: ReadCounter) -> OpenCheckpoint:
    """A file, a single-file directory or a sharded directory (only the index is read:
    `flashcp.models.weight_files.locate`)."""
    found = locate(path, counter)
    opened = {found.files[0]: found.single} if found.single is not None else {}
    return OpenCheckpoint(found.path, found.key_files, found.files, opened, found.index)


def index_problems(path: str | os.PathLike[str], args: ModelArgs) -> list[Problem]:
    """What the checkpoint at `path` lacks for a model of `args`, from its index (or its single
    file's header) alone, no tensor read: the embeddings, every decoder layer and every MTP
    layer `args` builds must have tensors there, each problem under its config key with the
    change that fixes it, if any. (A `model.from_pretrained` directory whose config.json
    declares MTP layers its weights lack is refused by the config's own check,
    `hf_mtp.mtp_problems`; this covers `checkpoint.init_from`, with the same rule,
    `hf_mtp.missing_mtp_layers`.) A checkpoint that cannot be opened raises as
    `load_hf_checkpoint`."""
    ckpt = open_checkpoint(path, ReadCounter())
    where = ckpt.index or ckpt.files[0]
    keys = list(ckpt.key_files)
    layers = {int(m.group(1)) for k in keys if (m := _LAYER_RE.match(k))}
    problems: list[Problem] = []
    missing = [i for i in range(args.num_layers) if i not in layers]
    if missing or not any(k.startswith("model.embed_tokens.") for k in keys):
        what = f"decoder layers {_ranges(missing)}" if missing else "model.embed_tokens"
        problems.append(Problem(
            "checkpoint.init_from",
            f"{where} has no tensors of {what} (model.num_layers {args.num_layers}): it is not a "
            "complete checkpoint of this model; download the missing shards or point at the "
            "complete directory",
        ))  # fmt: skip
    absent = missing_mtp_layers(keys, args.num_layers, args.mtp_layers)
    if absent:
        problems.append(Problem(
            "model.mtp_layers",
            f"{args.mtp_layers} multi-token-prediction layer(s) are built (model.mtp_layers), "
            f"but {where} holds no tensor of model.layers.{absent[0]}.* (MTP layer "
            f"{_ranges(absent)} is absent)",
            (as_fix({"model.mtp_layers": absent[0] - args.num_layers}),),
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


def dtype_name(tensor: paddle.Tensor) -> str:
    return str(tensor.dtype).replace("paddle.", "")


@dataclass
class Fit:
    """A checkpoint that fits a module (`check_fit`): what to read from each file, and the
    checkpoint's keys the module leaves alone."""

    reads: dict[Path, list[tuple[HFEntry, TensorInfo]]]
    """File → (the key's entry, its header info) of each tensor to load from it."""
    skipped: list[str] = field(default_factory=list)
    """Keys ignored on purpose (tied head, inv_freq, MTP layers the model does not build,
    unexpected with strict=False)."""
    skipped_mtp: list[int] = field(default_factory=list)
    """The checkpoint's MTP layers (global indices) the model does not build."""
    foreign: list[str] = field(default_factory=list)
    """Keys of other pipeline stages (or other ep ranks' experts)."""


def check_fit(
    module: nn.Layer,
    ckpt: OpenCheckpoint,
    counter: ReadCounter,
    strict: bool,
    names: Collection[str] | None,
) -> Fit:
    """Check every key, shape and dtype this module needs; the `Fit` (file → what to read
    from it, and the keys left alone).

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
    fit = Fit({}, skipped_mtp=sorted(extra_mtp))
    unexpected: list[str] = []
    for key in sorted(set(ckpt.key_files) - set(held_entries)):
        if _skippable(key, args, extra_mtp):
            fit.skipped.append(key)
        elif _foreign(key, args, held, experts):
            fit.foreign.append(key)
        else:
            unexpected.append(key)
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
            cast_raw(np.empty(0, RAW_DTYPES[info.dtype]), info.dtype, dtype_name(entry.tensor))
        except CastError as exc:
            uncastable.append(f"{key} in {f.name}: {exc}")
            continue
        fit.reads.setdefault(f, []).append((entry, info))
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
    fit.skipped.extend(unexpected)
    return fit
