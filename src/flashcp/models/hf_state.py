"""Which model tensor each key of a Hugging Face checkpoint fills: the one map the loader
(`flashcp.models.hf_load`), its checks (`flashcp.models.hf_check`), the exporter
(`flashcp.models.hf_save`) and the merged LoRA export (`flashcp.checkpoint.merge_export`) share.

Parameter names already follow the HF layouts (GLM-4 ``Glm4ForCausalLM``, GLM-4.5
``Glm4MoeForCausalLM``; GPT uses flashcp's own names in the same style, see
`flashcp.models.gpt`), so a checkpoint key IS the Paddle structured name, e.g.
``model.layers.3.self_attn.q_proj.weight`` or ``model.layers.1.mlp.gate.e_score_correction_bias``.
The differences, all here: orientation (Paddle `Linear` and the MoE router store `[in, out]`,
HF `[out, in]`, so those weights are transposed on the way in and out); stacked experts (one
``gate_up_proj`` / ``down_proj`` tensor per layer here, one key per expert and projection
there); and a family's renamed tensors (`flashcp.models.families.hf.Rename`). Multi-token-
prediction layers are decoder layers numbered from ``num_layers`` on, with the names and
orientations of any layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle import nn

from flashcp.models.config import ModelArgs
from flashcp.models.moe import TopkRouter


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


def held_experts(module: nn.Layer) -> dict[str, tuple[range, int]]:
    """Stacked-experts layer name → (the experts it holds, its layer's experts in all)."""
    out = {}
    for name, layer in module.named_sublayers():
        if getattr(layer, "STACKED_EXPERTS", False):
            first, count = int(layer.first_expert), int(layer.num_experts)
            total = int(getattr(layer, "total_experts", count))
            out[name] = (range(first, first + count), total)
    return out
