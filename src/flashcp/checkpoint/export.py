"""`flashcp export RUN_DIR OUT`: a run's trained weights as a Hugging Face model directory.

    report = export_run("runs/sft", "exports/sft", merge_lora=True, dtype="bfloat16")

OUT gets what ``transformers`` (``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer``)
and flashcp's own `model.from_pretrained` load: ``config.json``
(`flashcp.models.hf_config.hf_config`: the right ``architectures``, both RoPE layouts, and the
token ids the run used: `run_token_ids`), ``model-0000i-of-0000n.safetensors`` shards in the HF
orientation and key names plus ``model.safetensors.index.json``, the run's tokenizer (the files
of a ``data.tokenizer`` directory or ``tokenizer.json``; the byte tokenizer as a directory
`ByteTokenizer.save_pretrained` writes) and ``generation_config.json`` (copied from the
directory the run started from, or written from the known token ids; absent when none is).

Streamed: no process builds the whole model. The layers are grouped into shards of at most
`max_shard_bytes` (one decoder layer at least; the embeddings go with the first, the final norm
and LM head with the last), and each shard is built alone as a pipeline stage
(`flashcp.models.build_model(stage=...)`), filled, written tensor by tensor
(`flashcp.checkpoint.merge_export.merged_specs`) and dropped before the next. Its values come from
the run's newest intact checkpoint (or `checkpoint`), reading only the shard's tensors:

* full fine-tuning: the checkpoint's model parts (the full model's names, any pipeline layout);
* LoRA (``--merge-lora``): the base weights as the run started — `checkpoint.init_from` /
  `model.from_pretrained`, else the seeded init, which depends on (train.seed, name) only — plus
  the checkpoint's adapters (or ``RUN_DIR/adapters`` when no checkpoint was kept), merged as
  ``W + A·B·alpha/rank`` in float32 and rounded once to the export dtype.

The multi-token-prediction layers (`flashcp.models.mtp`, ``model.mtp_layers``) go with the last
shard under their HF names (``model.layers.{num_layers + d}.*``) and config.json says
``num_nextn_predict_layers``; carried frozen (``model.mtp_loss_weight: 0``) they are written as
they started, bit for bit in the dtype they were loaded and stored in (with LoRA: the base's,
never merged with adapters).

The export dtype is the run's `train.param_dtype` unless `dtype` says otherwise (parameters are
cast once, round-to-nearest-even into bfloat16; buffers such as GLM-4.5's float32
``e_score_correction_bias`` keep their dtype). OUT is written under ``OUT.partial`` and renamed
when complete, so a failed export leaves no half directory; an existing non-empty OUT is
refused.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.checkpoint import format as ckpt
from flashcp.checkpoint.adapters import adapter_files, load_trainable_arrays
from flashcp.checkpoint.fused_adapters import ADAPTERS_FOR, FusedExportError, export_fused_adapters
from flashcp.checkpoint.fused_adapters import SHARD as FUSED_SHARD
from flashcp.checkpoint.merge_export import merged_specs, write_merged_index
from flashcp.checkpoint.parts import ADAPTER_DIR
from flashcp.checkpoint.state import load_model_arrays
from flashcp.config import Config, build_config, read_yaml
from flashcp.data.tokenizer import ByteTokenizer, build_tokenizer
from flashcp.lora.model import apply_lora
from flashcp.models import StageSpec, build_model, estimate_parameters
from flashcp.models.hf_config import TOKEN_ID_KEYS, read_config_json
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.models.mtp import freeze_mtp_layers
from flashcp.models.safetensors_stream import write_streaming
from flashcp.models.weight_files import shard_file
from flashcp.rundir import CONFIG_FILE as RUN_CONFIG

EXPORT_DTYPES = ("float32", "bfloat16")
DEFAULT_SHARD_BYTES = 5 * 2**30
"""Shard size HF uses by default (5 GB); each shard is built alone while exporting."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files of a Hugging Face tokenizer directory that an export copies (those present)."""
GENERATION_CONFIG = "generation_config.json"
_ITEM_BYTES = {"float32": 4, "bfloat16": 2}


class ExportError(ValueError):
    """The run cannot be exported as asked; the message says why and what to do."""


@dataclass
class ExportReport:
    """What `export_run` wrote and from where."""

    out: Path
    source: Path
    """The checkpoint (or adapters directory) the trained values came from."""
    dtype: str
    shards: list[str] = field(default_factory=list)
    shard_layers: list[range] = field(default_factory=list)
    max_shard_parameters: int = 0
    """The most parameters any one process held at once (one shard's)."""
    tokenizer_files: list[str] = field(default_factory=list)
    generation_config: bool = False
    notes: list[str] = field(default_factory=list)


# -------------------------------------------------------------------------- the run's parts


def load_run_config(run_dir: Path) -> Config:
    """The resolved config the run wrote (`RUN_DIR/config.yaml`), not re-checked against this
    machine (its data paths may be elsewhere); the model section is checked."""
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise ExportError(
            f"{run_dir} has no {RUN_CONFIG}: give the run.output_dir of a flashcp run"
        )
    return build_config(read_yaml(path), source=str(path), check=False)


def _checkpoint_parts(path: Path, adapters: bool) -> list[Path]:
    """The model (or adapter) safetensors parts of checkpoint `path`, after verifying it."""
    try:
        files = ckpt.read_layout(path).model
    except ckpt.CheckpointError as exc:
        raise ExportError(f"checkpoint {path} is broken: {'; '.join(exc.problems)}") from None
    if adapters != all(f.parent.name == ADAPTER_DIR for f in files):
        what = "LoRA adapters" if adapters else "full model weights"
        raise ExportError(f"checkpoint {path} does not hold {what} (its manifest lists {files})")
    return files


def find_source(
    run_dir: Path, cfg: Config, checkpoint: str | Path | None
) -> tuple[Path, list[Path]]:
    """(where the trained values come from, its safetensors files)."""
    lora = "lora" in cfg.extras
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_dir():
            raise ExportError(f"--checkpoint {path} is not a checkpoint directory")
        return path, _checkpoint_parts(path, lora)
    found = ckpt.latest_checkpoint(run_dir / ckpt.CHECKPOINT_DIR)
    if found is not None:
        return found, _checkpoint_parts(found, lora)
    final = run_dir / ADAPTER_DIR
    parts = adapter_files(final)
    if lora and parts:
        return final, parts
    raise ExportError(
        f"no intact checkpoint under {run_dir / ckpt.CHECKPOINT_DIR}"
        + (f" and no {final}" if lora else "")
        + ": train with checkpoint.save_last true (the default: the last step is saved) or "
        "checkpoint.every > 0, or pass --checkpoint"
    )


def _read(reader: ckpt.TensorReader, names: Sequence[str], what: str) -> dict[str, np.ndarray]:
    """The trained values of `names` (all of them, or `ExportError`)."""
    missing = reader.missing(names)
    if missing:
        raise ExportError(
            f"the {what} lack {len(missing)} tensors of this model, e.g. {missing[:3]}: was "
            "the run's config.yaml changed after training?"
        )
    return reader.read(names)


# ------------------------------------------------------------------------------- sharding


def plan_shards(args: Any, item_bytes: int, max_shard_bytes: int) -> list[range]:
    """Consecutive decoder-layer groups whose weights (embeddings with the first, final norm +
    head with the last) stay within `max_shard_bytes` where a layer allows it."""
    n = args.num_layers

    def size(layers: range, first: bool, last: bool) -> int:
        return estimate_parameters(args, layers=layers, first=first, last=last) * item_bytes

    groups: list[range] = []
    start = 0
    for i in range(1, n + 1):
        if i == n:
            groups.append(range(start, n))
            break
        if size(range(start, i + 1), start == 0, i + 1 == n) > max_shard_bytes:
            groups.append(range(start, i))
            start = i
    return groups


def _build_shard(cfg: Config, spec: StageSpec, reader: ckpt.TensorReader, lora: bool) -> Any:
    """Shard `spec` with the run's trained values."""
    args = cfg.model
    # every parameter is read next (the run's checkpoint; with LoRA the base from init_from)
    filled = not lora or cfg.checkpoint.init_from is not None
    model = build_model(
        args, stage=spec, param_dtype=cfg.train.param_dtype, seed=cfg.train.seed,
        allow_large_on_cpu=True, initialise=not filled,
    )  # fmt: skip
    if not lora:
        names = list(model.state_dict())
        load_model_arrays(model, _read(reader, names, "checkpoint's model parts"))
        return model
    if cfg.checkpoint.init_from is not None:
        load_hf_checkpoint(model, cfg.checkpoint.init_from)
    section = cfg.extras["lora"]
    apply_lora(
        model,  # type: ignore[arg-type]
        rank=int(section.rank),
        alpha=float(section.alpha),
        dropout=float(section.dropout),
        target_modules=list(section.target_modules),
        seed=cfg.train.seed,
        require_match=False,
    )
    if not args.mtp_trained:  # as training froze them (`flashcp.parallelize`): no adapters saved
        freeze_mtp_layers(model)
    names = [n for n, p in model.named_parameters() if not p.stop_gradient]
    load_trainable_arrays(model, _read(reader, names, "adapters"))
    return model


# ----------------------------------------------------------------------- tokenizer, configs


def _started_from(cfg: Config) -> Path | None:
    """The HF directory the run's weights started from, if any."""
    for path in (cfg.model_from_pretrained, cfg.checkpoint.init_from):
        if path is not None and Path(path).is_dir():
            return Path(path)
    return None


def run_token_ids(cfg: Config, notes: list[str] | None = None) -> dict[str, Any]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a run's HF ``config.json``.

    Started from an HF directory: the ids its config.json records (absent ones stay absent,
    so transformers' defaults for that model apply as they did to the original). From scratch:
    the ids the run's tokenizer gave the data, each key present — an explicit null where the
    tokenizer has no such token or cannot be loaded here (said in `notes`) — so transformers
    never fills in its model class's defaults (GLM's 151329..., outside a small vocabulary).
    """
    start = _started_from(cfg)
    if start is not None and (start / "config.json").is_file():
        config, _ = read_config_json(start)
        return {k: config[k] for k in TOKEN_ID_KEYS if config.get(k) is not None}
    try:
        tok = build_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError) as exc:
        if notes is not None:
            notes.append(f"token ids written as null: data.tokenizer did not load here ({exc})")
        return dict.fromkeys(TOKEN_ID_KEYS)
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def copy_tokenizer(tokenizer: str, out: Path) -> list[str]:
    """Put the run's tokenizer into `out` (its files; the byte tokenizer written as an HF
    tokenizer directory); returns the file names."""
    if tokenizer == "byte":
        return ByteTokenizer().save_pretrained(out)
    source = Path(tokenizer)
    if source.is_file():
        shutil.copyfile(source, out / "tokenizer.json")
        return ["tokenizer.json"]
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def write_generation_config(start: Path | None, token_ids: dict[str, Any], out: Path) -> bool:
    """`generation_config.json`: the starting directory's, else one from the known token ids."""
    if start is not None and (start / GENERATION_CONFIG).is_file():
        shutil.copyfile(start / GENERATION_CONFIG, out / GENERATION_CONFIG)
        return True
    known = {k: v for k, v in token_ids.items() if v is not None}
    if not known:
        return False
    (out / GENERATION_CONFIG).write_text(json.dumps(known, indent=2) + "\n")
    return True


def finish_hf_directory(
    out: Path, cfg: Config, num_shards: int, dtype: str, notes: list[str] | None = None
) -> tuple[list[str], list[str], bool]:
    """Make a directory of merged weight shards a complete Hugging Face model directory: the
    index and ``config.json`` (the run's token ids), the run's tokenizer (its chat template
    with it) and ``generation_config.json``. The one finish of `export_run` (``flashcp export``)
    and of a run's ``lora.merge_at_end`` (`flashcp.checkpoint.checkpointer`), so both
    directories hold the same files. Returns (shard names, tokenizer files, whether a
    generation config was written); problems worth saying go to `notes`."""
    token_ids = run_token_ids(cfg, notes)
    shards = write_merged_index(out, cfg.model, num_shards, dtype, token_ids=token_ids)
    tokenizer_files = copy_tokenizer(cfg.data.tokenizer, out)
    if not tokenizer_files and notes is not None:
        notes.append(f"no tokenizer files: data.tokenizer is {cfg.data.tokenizer!r}")
    generation = write_generation_config(_started_from(cfg), token_ids, out)
    return shards, tokenizer_files, generation


# ---------------------------------------------------------------------------------- export


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: export into a new directory")


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh `OUT.partial` directory, renamed to `out` when the block succeeds."""
    _check_out(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)


def _export_adapters(
    run: Path,
    out: Path,
    cfg: Config,
    target: str,
    merge_lora: bool,
    dtype: str | None,
    checkpoint: str | Path | None,
) -> ExportReport:
    """`export_run(..., adapters_for=target)`: the run's adapters in the fused layout."""
    if target not in ADAPTERS_FOR:
        raise ExportError(f"--adapters-for {target!r}: use one of {', '.join(ADAPTERS_FOR)}")
    if "lora" not in cfg.extras:
        raise ExportError(
            f"--adapters-for: {run} has no lora section (it trained every weight): export "
            "without it"
        )
    if merge_lora or dtype not in (None, "float32"):
        raise ExportError(
            "--adapters-for writes the float32 adapters alone: drop --merge-lora / --dtype"
        )
    source, files = find_source(run, cfg, checkpoint)
    try:
        settings = export_fused_adapters(files, cfg.model, cfg.extras["lora"], out, _staging)
    except FusedExportError as exc:
        raise ExportError(str(exc)) from None
    report = ExportReport(out=out, source=source, dtype="float32", shards=[FUSED_SHARD])
    report.notes.append(
        f"PaddleFormers LoRA (fused qkv_proj / up_gate_proj): r {settings['r']}, lora_alpha "
        f"{settings['lora_alpha']:g} (scaling {settings['lora_alpha'] / settings['r']:g}, the "
        "run's alpha / rank), target_modules " + ", ".join(settings["target_modules"])
    )
    return report


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    merge_lora: bool = False,
    dtype: str | None = None,
    checkpoint: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    adapters_for: str | None = None,
) -> ExportReport:
    """Write the run's model as a Hugging Face directory `out` (see the module docstring);
    with `adapters_for` ("paddleformers") the LoRA adapters alone, for PaddleFormers' fused
    GLM-4.5 class (`flashcp.checkpoint.fused_adapters`)."""
    run, target = Path(run_dir), Path(out)
    _check_out(target)
    cfg = load_run_config(run)
    lora = "lora" in cfg.extras
    if adapters_for is not None:
        return _export_adapters(run, target, cfg, adapters_for, merge_lora, dtype, checkpoint)
    if lora and not merge_lora:
        raise ExportError(
            f"{run} trained LoRA adapters (its config has a lora section): pass --merge-lora to "
            "fold them into the weights, or --adapters-for paddleformers to write the adapters "
            "alone for PaddleFormers' GLM-4.5 class (flashcp's own adapters, in PaddleFormers' "
            f"format on the HF projections, are the checkpoint's {ADAPTER_DIR}/ directory)"
        )
    if merge_lora and not lora:
        raise ExportError(f"--merge-lora: {run} has no lora section (it trained every weight)")
    dtype = dtype or cfg.train.param_dtype
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype!r}: use one of {', '.join(EXPORT_DTYPES)}")
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    source, files = find_source(run, cfg, checkpoint)
    report = ExportReport(out=target, source=source, dtype=dtype)
    groups = plan_shards(cfg.model, _ITEM_BYTES[dtype], max_shard_bytes)
    with _staging(target) as tmp, contextlib.ExitStack() as stack:
        reader = ckpt.TensorReader(files, stack)
        for index, layers in enumerate(groups):
            spec = StageSpec(index, len(groups), layers)
            model = _build_shard(cfg, spec, reader, lora)
            n = estimate_parameters(cfg.model, layers=layers, first=spec.is_first,
                                    last=spec.is_last)  # fmt: skip
            report.max_shard_parameters = max(report.max_shard_parameters, n)
            write_streaming(
                tmp / shard_file(index, len(groups)),
                merged_specs(model, dtype),
                metadata={"format": "pt"},
            )
            del model
        report.shards, report.tokenizer_files, report.generation_config = finish_hf_directory(
            tmp, cfg, len(groups), dtype, report.notes
        )
        report.shard_layers = groups
    hf = cfg.model.family.hf
    if hf is not None and not hf.transformers:
        report.notes.append(
            f"arch {cfg.model.arch} is flashcp's own model: model.from_pretrained loads this "
            "export, transformers does not"
        )
    return report
