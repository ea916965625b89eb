"""A run's LoRA adapters for PaddleFormers' own GLM-4.5 classes (`flashcp export RUN OUT
--adapters-for paddleformers`): its fused layout, the same function exactly.

flashcp's adapters sit on the Hugging Face projections (``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj``, ...; `flashcp.checkpoint.adapters`). PaddleFormers 1.2.0's GLM-4.5
(``paddleformers.transformers.glm4_moe``, e.g. ``Glm4MoeForCausalLMDeprecated``) fuses them:

* ``self_attn.qkv_proj`` `[H, (n_q + 2 n_kv) d]`: its ``fused_qkv`` conversion orders the
  output columns per KV head g as the g-th group's query heads, key head g, value head g
  (``[q_{gG}, …, q_{gG+G-1}, k_g, v_g]``, G = n_q / n_kv, each head d columns), which its
  forward reshapes to `[n_kv, (G + 2) d]` and splits;
* ``mlp.up_gate_proj`` (dense MLP, shared experts, each routed expert ``mlp.experts.{e}``)
  `[H, 2I]`: ``fused_ffn`` puts gate in columns `[0, I)` and up in `[I, 2I)` (its forward
  ``chunk(2)`` takes gate first) — the layout of flashcp's stacked ``experts.gate_up_proj``.

A LoRA on a fused projection, ``x·A·B·s`` with A `[H, R]`, B `[R, out]`, is one low-rank update
of the whole output; separate q/k/v adapters are three independent ones. They are the same
function exactly when A stacks the pieces' A side by side and B is block-diagonal: piece i's
rows ``[i·r, (i+1)·r)`` of B hold its B in its own output columns and zeros elsewhere, so
``x·A·B`` adds, per output column, the one piece's ``x·A_i·B_i`` and exact zeros. The fused
rank is the sum of the pieces' ranks (3r for q, k, v). PaddleFormers has one ``r`` and
``lora_alpha`` for every module, so every adapter is padded with zero columns of A and zero rows
of B to the largest fused rank R, and ``lora_alpha`` becomes alpha·R/r: the scaling
``lora_alpha / r`` stays alpha/r (the same float for integer alpha: both quotients round the
same real number). Padding adds exact zeros; a module flashcp did not adapt gets no adapter
(``target_modules`` lists exactly the adapted ones). A run whose adapters have no place in
PaddleFormers' model (MTP layers, which its eager class does not build) or whose model it has
no class for (GLM-4, GPT) is refused with the route that works: ``--merge-lora``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.checkpoint import format as ckpt
from flashcp.checkpoint.adapters import write_adapter_arrays
from flashcp.lora.model import SAFE_INDEX_FILE, _quiet
from flashcp.models.config import ModelArgs
from flashcp.models.hf_config import CONFIG_FILE, hf_config

ADAPTERS_FOR = ("paddleformers",)
"""Targets of `flashcp export --adapters-for`."""
SHARD = "peft_model-00001-of-00001.safetensors"
_LINEAR = re.compile(r"^(model\.layers\.(\d+)\.(?:self_attn|mlp(?:\.shared_experts)?))\.(\w+)$")
_EXPERTS = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)_lora_[AB]$")
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "up_gate_proj", "up_proj": "up_gate_proj"}  # fmt: skip


class FusedExportError(ValueError):
    """Adapters that have no exact place in PaddleFormers' fused GLM-4.5 model."""


@dataclass
class FusedModule:
    """One PaddleFormers module's adapter, built from flashcp pieces: (A `[in, r]`, B `[r, k]`,
    the fused output columns B's k columns go to) each."""

    out: int
    pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return sum(int(a.shape[1]) for a, _, _ in self.pieces)

    def arrays(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(A `[in, rank]`, B `[rank, out]`): pieces side by side in A, block-diagonal in B,
        zero-padded to `rank`."""
        fan_in = int(self.pieces[0][0].shape[0])
        a = np.zeros((fan_in, rank), np.float32)
        b = np.zeros((rank, self.out), np.float32)
        at = 0
        for pa, pb, columns in self.pieces:
            r = int(pa.shape[1])
            a[:, at : at + r] = pa
            b[at : at + r, columns] = pb
            at += r
        return a, b


def qkv_columns(args: ModelArgs) -> dict[str, np.ndarray]:
    """Where q, k and v's output columns go in PaddleFormers' fused ``qkv_proj`` (module
    docstring): for KV head g, its G query heads, then k_g, then v_g."""
    d, kv = args.head_size, args.num_kv_heads
    group = args.num_heads // kv
    width = (group + 2) * d
    heads = np.arange(d)
    q = [g * width + j * d + heads for g in range(kv) for j in range(group)]
    k = [g * width + group * d + heads for g in range(kv)]
    v = [g * width + (group + 1) * d + heads for g in range(kv)]
    return {"q_proj": np.concatenate(q), "k_proj": np.concatenate(k), "v_proj": np.concatenate(v)}


def fuse_adapters(
    arrays: Mapping[str, np.ndarray], args: ModelArgs
) -> dict[str, FusedModule]:
    """flashcp's adapter arrays (`name.lora_A` / `name.lora_B`, stacked experts'
    `..._lora_A` `[E, in, r]`) → PaddleFormers module name → `FusedModule`.
    `FusedExportError` for adapters PaddleFormers' GLM-4.5 has no module for."""
    if not args.family.paddleformers_fused_adapters:
        raise FusedExportError(
            f"PaddleFormers 1.2.0 has no class with fused projections for arch {args.arch!r} "
            "(its fused GLM class is GLM-4.5, glm_moe): export with --merge-lora instead"
        )
    qkv = qkv_columns(args)
    qkv_width = (args.num_heads + 2 * args.num_kv_heads) * args.head_size
    modules: dict[str, FusedModule] = {}
    stray: list[str] = []
    for name in sorted(arrays):
        if m := _EXPERTS.match(name):
            if name.endswith("_lora_A"):
                _add_experts(modules, arrays, m.group(1), m.group(3))
            layer = int(m.group(2))
        elif name.endswith(".lora_A") and (m := _LINEAR.match(name[: -len(".lora_A")])):
            parent, layer, leaf = m.group(1), int(m.group(2)), m.group(3)
            a, b = arrays[name], arrays[name[: -len("A")] + "B"]
            out = int(b.shape[1])
            if leaf in ("q_proj", "k_proj", "v_proj"):
                columns, width = qkv[leaf], qkv_width
            elif leaf in ("gate_proj", "up_proj"):
                columns, width = np.arange(out) + (out if leaf == "up_proj" else 0), 2 * out
            else:
                columns, width = np.arange(out), out
            target = f"{parent}.{_FUSED.get(leaf, leaf)}"
            modules.setdefault(target, FusedModule(width)).pieces.append((a, b, columns))
        elif name.endswith(".lora_B"):
            continue
        else:
            stray.append(name)
            continue
        if layer >= args.num_layers:
            stray.append(name)
    if stray:
        raise FusedExportError(
            f"adapters {stray[:4]} have no module in PaddleFormers' GLM-4.5 class (e.g. the "
            "multi-token-prediction layers, which its eager class does not build): export "
            "with --merge-lora instead"
        )
    if not modules:
        raise FusedExportError("the run holds no adapters to export")
    return modules


def _add_experts(
    modules: dict[str, FusedModule], arrays: Mapping[str, np.ndarray], prefix: str, proj: str
) -> None:
    """Stacked expert adapters → each expert's ``mlp.experts.{e}.up_gate_proj`` / ``down_proj``
    (flashcp's ``gate_up_proj`` columns are already gate then up, PaddleFormers' order)."""
    a, b = arrays[f"{prefix}.{proj}_lora_A"], arrays[f"{prefix}.{proj}_lora_B"]
    leaf = "up_gate_proj" if proj == "gate_up_proj" else "down_proj"
    for e in range(int(a.shape[0])):
        out = int(b.shape[2])
        modules[f"{prefix}.{e}.{leaf}"] = FusedModule(out, [(a[e], b[e], np.arange(out))])


def target_patterns(names: list[str]) -> list[str]:
    """Regexes (PaddleFormers' ``re.fullmatch``) matching exactly the module `names`: one per
    module kind, over the layer (and expert) numbers it has."""
    kinds: dict[str, set[int]] = {}
    for name in names:
        parts = name.split(".")
        rest = parts[3:]
        if rest[:2] == ["mlp", "experts"]:  # every expert of a layer is adapted, or none
            rest = ["mlp", "experts", "*", *rest[3:]]
        kinds.setdefault(".".join(rest), set()).add(int(parts[2]))
    patterns = []
    for kind, where in sorted(kinds.items()):
        layers = [str(i) for i in sorted(where)]
        body = re.escape(kind).replace(r"\*", r"\d+")
        patterns.append(rf"model\.layers\.(?:{'|'.join(layers)})\.{body}")
    return patterns


def write_fused_adapters(
    arrays: Mapping[str, np.ndarray],
    args: ModelArgs,
    rank: int,
    alpha: float,
    out: Path,
    *,
    dropout: float = 0.0,
) -> dict[str, Any]:
    """Write PaddleFormers' adapter directory for its GLM-4.5 class into `out` (existing and
    empty): the fused adapters (one shard + ``peft_model.safetensors.index.json``),
    ``lora_config.json`` (PaddleFormers' ``LoRAConfig``) and the HF ``config.json`` of the base
    model. Returns what `LoRAConfig` got (r, lora_alpha, target_modules)."""
    modules = fuse_adapters(arrays, args)
    fused_rank = max(m.rank for m in modules.values())
    tensors: dict[str, np.ndarray] = {}
    for name, module in modules.items():
        a, b = module.arrays(fused_rank)
        tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"] = a, b
    write_adapter_arrays(out / SHARD, tensors)
    total = sum(int(t.nbytes) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(sorted(tensors), SHARD)}
    (out / SAFE_INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n")
    settings = {
        "r": fused_rank,
        "lora_alpha": alpha * fused_rank / rank,
        "lora_dropout": float(dropout),
        "target_modules": target_patterns(sorted(modules)),
        "dtype": "float32",
    }
    from paddleformers.peft import LoRAConfig

    with _quiet():
        LoRAConfig(**settings).save_pretrained(str(out))
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(args), indent=2) + "\n")
    return settings


def export_fused_adapters(
    files: list[Path],
    args: ModelArgs,
    lora: Any,
    out: Path,
    staging: Callable[[Path], contextlib.AbstractContextManager[Path]],
) -> dict[str, Any]:
    """The adapters in checkpoint `files` (the `lora` config section's rank / alpha / dropout)
    written by `write_fused_adapters` through `staging(out)` (the export's ``OUT.partial``,
    renamed when complete)."""
    with contextlib.ExitStack() as stack:
        reader = ckpt.TensorReader(files, stack)
        arrays = reader.read(reader.names())
    with staging(out) as tmp:
        settings = write_fused_adapters(
            arrays, args, int(lora.rank), float(lora.alpha), tmp, dropout=float(lora.dropout)
        )
    return settings

