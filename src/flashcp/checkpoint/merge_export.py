"""The merged LoRA export, streamed: each pipeline stage writes its own HF-layout shard.

No rank ever holds more than its stage: stage `s`'s writer computes, one tensor at a time,
``W + A·B·alpha/rank`` (float32, cast back to W's storage dtype) for its adapted layers and
copies every other weight, transposed to the Hugging Face `[out, in]` layout
(`flashcp.models.hf_state.hf_state_map` names and orientations), straight into
`model-0000{s+1}-of-0000{pp}.safetensors` (`flashcp.models.safetensors_stream`). Rank 0 then
writes `model.safetensors.index.json` (read from the shards' headers) and `config.json`, so the
directory loads with `flashcp.models.hf_load.load_hf_checkpoint` (or Hugging Face's
loaders) whatever the pipeline layout was. A tied embedding is written once, by the first
stage (the last stage's copy is equal).

Multi-token-prediction layers (`flashcp.models.mtp`, the last stage's
``model.layers.{num_layers + d}``) are written under the same names as any layer. Carried
frozen (``model.mtp_loss_weight: 0``) they never trained, so any adapters on them are not
merged: their base weights pass through unchanged, bit for bit.

Expert parallelism: HF keys are per expert (``mlp.experts.{e}.gate_proj.weight``), so each ep
rank's writer streams its own experts as a shard of its own — shard ``s·ep + r`` of ``pp·ep``
for ep rank r of stage s — and only ep rank 0 adds the stage's other tensors; nothing is
gathered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from safetensors import safe_open

from flashcp.lora.experts import is_expert_lora, merged_piece
from flashcp.lora.model import lora_layers
from flashcp.models.hf_config import CONFIG_FILE, hf_config
from flashcp.models.hf_mtp import mtp_depth
from flashcp.models.hf_state import HFEntry, hf_state_map
from flashcp.models.precision import float32_math
from flashcp.models.safetensors_stream import (
    ITEM_SIZE,
    TensorSpec,
    safetensors_dtype,
    write_streaming,
)
from flashcp.models.weight_files import is_weight_file, shard_file, write_index


def _merged(layer: Any, transposed: bool, dtype: str | None = None) -> np.ndarray:
    if getattr(layer, "merged", False):
        raise RuntimeError("the adapters are already merged into the base weights")
    with paddle.no_grad(), float32_math():  # float32 on GPU too: no TF32
        w = layer.weight.astype("float32")
        delta = paddle.matmul(layer.lora_A.astype("float32"), layer.lora_B.astype("float32"))
        out = (w + delta * float(layer.scaling)).astype(dtype or layer.weight.dtype)
        if transposed:
            out = out.transpose([1, 0])
        return out.numpy()


def _cast(t: paddle.Tensor, dtype: str | None) -> paddle.Tensor:
    """`t` in `dtype` (widened exactly to float32 first, then one rounding); None keeps it."""
    return t if dtype is None else t.astype("float32").astype(dtype)


def _plain(entry: HFEntry, dtype: str | None = None) -> np.ndarray:
    with paddle.no_grad():
        t = _cast(entry.value().detach(), dtype)
        out = (t.transpose([1, 0]) if entry.transposed else t).contiguous().numpy()
        return out.reshape(entry.stored) if entry.stored is not None else out


def _merged_expert(layer: Any, entry: HFEntry, dtype: str | None = None) -> np.ndarray:
    proj = entry.name.rsplit(".", 1)[1]
    piece = merged_piece(layer, proj, int(entry.expert), entry.columns)  # type: ignore[arg-type]
    return _cast(piece, dtype).transpose([1, 0]).contiguous().numpy()


def merged_specs(
    module: paddle.nn.Layer, dtype: str | None = None, *, experts_only: bool = False
) -> list[TensorSpec]:
    """What this stage writes: every HF key it owns, adapted weights merged (lazily; an
    adapted expert's pieces one expert at a time); `experts_only`: only the routed experts'
    keys (ep ranks > 0 under expert parallelism).

    `dtype` (float32 / bfloat16) casts every parameter on the way out (a merged weight is
    rounded once, from its float32 sum); buffers keep their dtype (GLM-4.5's float32
    `e_score_correction_bias`, as its own checkpoints store it); None keeps every dtype.
    Frozen MTP layers (`ModelArgs.mtp_trained` false) are written as they are, never merged."""
    adapted = dict(lora_layers(module))
    args = module.args  # type: ignore[attr-defined]
    skip_tied = bool(getattr(module, "num_stages", 1) > 1 and not module.is_first)  # type: ignore[attr-defined]
    params = {name for name, _ in module.named_parameters()}
    specs = []
    for key, entry in hf_state_map(module).items():
        if key.endswith(("lora_A", "lora_B")):  # `.lora_A` (Linear), `_lora_A` (experts)
            continue
        if skip_tied and key == "model.embed_tokens.weight":
            continue
        if experts_only and not entry.is_piece:
            continue
        owner = entry.name.rsplit(".", 1)[0]
        layer = adapted.get(owner) if key.endswith(".weight") or entry.is_piece else None
        if layer is not None and not args.mtp_trained and mtp_depth(key, args) is not None:
            layer = None  # frozen MTP layer: its adapters never trained
        cast = dtype if entry.name in params else None
        if layer is not None and entry.is_piece and is_expert_lora(layer):
            produce = lambda layer=layer, e=entry, c=cast: _merged_expert(layer, e, c)  # noqa: E731
        elif layer is not None:
            produce = lambda layer=layer, t=entry.transposed, c=cast: _merged(layer, t, c)  # noqa: E731
        else:
            produce = lambda e=entry, c=cast: _plain(e, c)  # noqa: E731
        code = safetensors_dtype(entry.tensor.dtype)
        if cast is not None:
            code = safetensors_dtype(f"paddle.{cast}")
        specs.append(TensorSpec(key, code, entry.hf_shape, produce))
    return specs


def write_merged_stage(
    module: paddle.nn.Layer, out: Path, *, ep_rank: int = 0, ep: int = 1
) -> Path:
    """Write this stage's merged shard into directory `out` (under expert parallelism: ep rank
    `ep_rank`'s of `ep`, see the module docstring); returns the file."""
    out.mkdir(parents=True, exist_ok=True)
    stage = int(getattr(module, "stage", 0))
    num_stages = int(getattr(module, "num_stages", 1))
    path = out / shard_file(stage * ep + ep_rank, num_stages * ep)
    specs = merged_specs(module, experts_only=ep_rank > 0)
    write_streaming(path, specs, metadata={"format": "pt"})
    return path


def write_merged_index(
    out: Path, args: Any, num_stages: int, dtype: str, *, token_ids: Any = None
) -> list[str]:
    """After every stage wrote its shard: the index, `config.json` (with `token_ids`, a None
    value as an explicit null: see `flashcp.models.hf_config.hf_config`), and the removal of
    weight files an earlier export (another layout) left; returns the shard names.
    `num_stages`: the number of shards (pp, or pp × ep under expert parallelism)."""
    names = [shard_file(s, num_stages) for s in range(num_stages)]
    weight_map: dict[str, str] = {}
    total = 0
    for name in names:
        with safe_open(str(out / name), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                weight_map[key] = name
                meta = f.get_slice(key)
                total += int(np.prod(meta.get_shape())) * ITEM_SIZE[meta.get_dtype()]
    write_index(out, weight_map, total)
    config = hf_config(args, dtype, token_ids=token_ids, nulls=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for stale in out.iterdir():
        if is_weight_file(stale.name) and stale.name not in names:
            stale.unlink()
    return names
