"""Hugging Face safetensors checkpoints: load into, and save from, flashcp models.

Parameter names already follow the HF layouts (GLM-4 ``Glm4ForCausalLM``, GLM-4.5
``Glm4MoeForCausalLM``; GPT uses flashcp's own names in the same style, see
`flashcp.models.gpt`), so a checkpoint key IS the Paddle structured name, e.g.
``model.layers.3.self_attn.q_proj.weight`` or ``model.layers.1.mlp.gate.e_score_correction_bias``.
The one difference is orientation: Paddle `Linear` (and the MoE router) store `[in, out]`,
HF `[out, in]`, so those weights are transposed on the way in and out.

`load_hf_checkpoint` reads a single ``.safetensors`` file or a directory holding either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. It checks every
key and shape from the file headers before reading any tensor, then loads one tensor at a
time (casting to the parameter's dtype). Skipped, never errors: ``lm_head.weight`` when the
embeddings are tied, ``*.rotary_emb.inv_freq`` (old exports), and for ``glm_moe`` the
multi-token-prediction layers GLM-4.5 ships after its last decoder layer.

`save_hf_checkpoint` writes the same layout (sharded above `max_shard_bytes`) plus an
HF-style ``config.json`` that also records the exact `ModelArgs`; `args_from_hf_config`
reads either kind of ``config.json`` back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import paddle
from paddle import nn
from safetensors import safe_open
from safetensors.paddle import save_file

from flashcp.models.config import ModelArgs
from flashcp.models.moe import TopkRouter

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
ARGS_KEY = "flashcp_model_args"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_SHOW = 12  # keys listed per kind of error

HF_ARCH = {
    "gpt": ("FlashcpGPTForCausalLM", "flashcp_gpt"),
    "glm": ("Glm4ForCausalLM", "glm4"),
    "glm_moe": ("Glm4MoeForCausalLM", "glm4_moe"),
}


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not fit the model."""


@dataclass(frozen=True)
class HFEntry:
    """One checkpoint key: the model tensor it fills and whether HF stores it transposed."""

    key: str
    tensor: paddle.Tensor
    transposed: bool

    @property
    def hf_shape(self) -> list[int]:
        shape = [int(s) for s in self.tensor.shape]
        return shape[::-1] if self.transposed else shape


@dataclass
class LoadReport:
    """What `load_hf_checkpoint` did."""

    files: list[str]
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def hf_state_map(model: nn.Layer) -> dict[str, HFEntry]:
    """Checkpoint key → `HFEntry` for every parameter and persistent buffer of `model`."""
    transposed = {
        f"{name}.weight"
        for name, layer in model.named_sublayers()
        if isinstance(layer, (nn.Linear, TopkRouter))
    }
    return {
        name: HFEntry(name, tensor, name in transposed)
        for name, tensor in model.state_dict().items()
    }


# ------------------------------------------------------------------------------- loading


def _checkpoint_files(path: str | os.PathLike[str]) -> tuple[dict[str, Path], list[Path]]:
    """(key → file, files) for a file, a single-file directory or a sharded directory."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir() and (p / INDEX_FILE).is_file():
        index = json.loads((p / INDEX_FILE).read_text())
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{p / INDEX_FILE} has no 'weight_map' object")
        files = sorted({p / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{p / INDEX_FILE} lists {f.name}, which does not exist")
        return {k: p / v for k, v in weight_map.items()}, files
    elif p.is_dir() and (p / SINGLE_FILE).is_file():
        files = [p / SINGLE_FILE]
    elif p.is_dir():
        found = sorted(p.glob("*.safetensors"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"{p} has no {SINGLE_FILE} or {INDEX_FILE} and {len(found)} other .safetensors "
                "files: point at one file or add the index"
            )
        files = found
    else:
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    keys: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="paddle") as handle:
            keys.update({k: f for k in handle.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return keys, files


def _skippable(key: str, args: ModelArgs) -> bool:
    if key.endswith("rotary_emb.inv_freq"):
        return True
    if key == "lm_head.weight" and args.tie_embeddings:
        return True
    m = _LAYER_RE.match(key)
    return args.arch == "glm_moe" and m is not None and int(m.group(1)) >= args.num_layers


def _listing(title: str, items: list[str], hint: str = "") -> str:
    shown = "\n".join(f"    {s}" for s in items[:_SHOW])
    more = f"\n    ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"  {title} ({len(items)}){hint}:\n{shown}{more}"


def load_hf_checkpoint(
    model: nn.Layer, path: str | os.PathLike[str], *, strict: bool = True
) -> LoadReport:
    """Fill `model` from an HF-layout safetensors checkpoint (file, directory or shards).

    Raises `CheckpointMismatchError` naming every missing key, unexpected key (only when
    `strict`) and shape mismatch (key, checkpoint shape, model shape) before loading any
    tensor, so a bad checkpoint leaves the model untouched.
    """
    args: ModelArgs = model.args  # type: ignore[attr-defined]
    entries = hf_state_map(model)
    key_files, files = _checkpoint_files(path)
    report = LoadReport(files=[str(f) for f in files])
    missing = sorted(set(entries) - set(key_files))
    unexpected, mismatched = [], []
    for key in sorted(set(key_files) - set(entries)):
        if _skippable(key, args):
            report.skipped.append(key)
        else:
            unexpected.append(key)
    by_file: dict[Path, list[str]] = {}
    for key in sorted(set(entries) & set(key_files)):
        by_file.setdefault(key_files[key], []).append(key)
    for f, keys in by_file.items():
        with safe_open(str(f), framework="paddle") as handle:
            for key in keys:
                shape = list(handle.get_slice(key).get_shape())
                want = entries[key].hf_shape
                if shape != want:
                    layout = " (HF [out, in] layout)" if entries[key].transposed else ""
                    mismatched.append(f"{key}: checkpoint {shape} vs model {want}{layout}")
    problems = []
    if missing:
        problems.append(_listing("missing from the checkpoint", missing))
    if unexpected and strict:
        problems.append(
            _listing("unexpected in the checkpoint", unexpected, " [strict=False skips them]")
        )
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched))
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit the {args.arch} model:\n" + "\n".join(problems)
        )
    report.skipped.extend(unexpected)
    for f, keys in by_file.items():
        with safe_open(str(f), framework="paddle") as handle:
            for key in keys:
                entry = entries[key]
                value = handle.get_tensor(key)
                if entry.transposed:
                    value = value.transpose([1, 0])
                value = value.astype(entry.tensor.dtype).contiguous()
                with paddle.no_grad():
                    paddle.assign(value.to(entry.tensor.place), output=entry.tensor)
                report.loaded.append(key)
    return report


# -------------------------------------------------------------------------------- saving


def hf_config(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """An HF-style `config.json` for `args`, plus the exact `ModelArgs` under ARGS_KEY."""
    architecture, model_type = HF_ARCH[args.arch]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rotary_base,
        "partial_rotary_factor": args.partial_rotary_factor,
        "attention_bias": args.qkv_bias,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.initializer_range,
        "torch_dtype": dtype,
    }
    if args.arch == "gpt":
        cfg.update(layer_norm_eps=args.norm_eps, hidden_act="gelu", position=args.position)
    else:
        cfg.update(rms_norm_eps=args.norm_eps, hidden_act="silu", rope_scaling=None)
    if args.arch == "glm_moe":
        cfg.update(
            n_routed_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            n_shared_experts=args.num_shared_experts,
            first_k_dense_replace=args.first_k_dense_replace,
            routed_scaling_factor=args.routed_scaling_factor,
            norm_topk_prob=args.norm_topk_prob,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=0,
            use_qk_norm=False,
        )
    cfg[ARGS_KEY] = args.to_dict()
    return cfg


def args_from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
) -> ModelArgs:
    """`ModelArgs` from a `config.json` (path or dict): ours exactly, or HF GLM-4 / GLM-4.5."""
    if not isinstance(config, Mapping):
        p = Path(config)
        config = json.loads((p / CONFIG_FILE if p.is_dir() else p).read_text())
    if ARGS_KEY in config:
        names = {f.name for f in fields(ModelArgs)}
        values = {k: v for k, v in config[ARGS_KEY].items() if k in names}
        return ModelArgs(**{**values, **overrides}).check()
    model_type = config.get("model_type")
    arch = {"glm4": "glm", "glm4_moe": "glm_moe"}.get(str(model_type))
    if arch is None:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported: flashcp reads glm4, "
            "glm4_moe and its own configs"
        )
    if config.get("rope_scaling"):
        raise ValueError(f"rope_scaling {config['rope_scaling']!r} is not implemented")
    if config.get("use_qk_norm"):
        raise ValueError("use_qk_norm=true (GLM-4.5 full size) is not implemented; Air is fine")
    if int(config.get("n_group", 1)) > 1 and config.get("topk_group") != config.get("n_group"):
        raise ValueError("group-limited expert routing (n_group > topk_group) is not implemented")
    values: dict[str, Any] = dict(
        arch=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim"),
        intermediate_size=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 4096),
        rotary_base=float(config.get("rope_theta", 10000.0)),
        partial_rotary_factor=float(config.get("partial_rotary_factor", 0.5)),
        qkv_bias=bool(config.get("attention_bias", True)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        initializer_range=float(config.get("initializer_range", 0.02)),
    )
    if arch == "glm_moe":
        values.update(
            num_experts=config.get("n_routed_experts", config.get("num_experts")),
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            num_shared_experts=config.get("n_shared_experts", 0),
            first_k_dense_replace=config.get("first_k_dense_replace", 0),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        )
    return ModelArgs(**{**values, **overrides}).check()


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
        t = entry.tensor.detach()
        if entry.transposed:
            t = t.transpose([1, 0])
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
