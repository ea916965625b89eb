"""Per-step router statistics of MoE models, and the load-balancing bias update.

Every MoE layer accumulates, over the step's micro-batches, the entries its router sent to each
expert, the entries the capacity dropped and its part of the sequence-balance loss
(`flashcp.models.moe.MoE.take_stats`). `RouterStats` packs them into one vector indexed by the
GLOBAL MoE layer (zeros for layers another pipeline stage holds; trained MTP layers,
`flashcp.models.mtp`, after the decoder layers), which the trainer appends to
its one per-step all-reduce over cp, dp and pp — so every rank ends up with the whole model's
loads summed over all ranks that saw different tokens, at no extra collective. From that:

* metrics (rank 0 writes them to `metrics.jsonl`): per layer the load ratio
  ``max_e c_e / mean_e c_e`` (1 = perfectly balanced, E/k = every token on the same k
  experts), summarised as ``moe/max_over_mean_max`` (worst layer) and
  ``moe/max_over_mean_mean`` (mean over layers); ``moe/aux_loss`` (the step's
  sequence-balance loss, summed over layers) when `model.router_aux_loss_coef` > 0;
  ``moe/drop_rate`` (dropped / routed entries) when `model.moe_capacity_factor` > 0.
* the bias update (`model.router_bias_update_rate` γ > 0): after an applied optimizer step,
  each rank moves the biases of the layers it holds by ``γ · sign(mean(c) - c)``
  (`flashcp.models.moe_balance.update_bias`), from the same summed loads, so ranks holding
  the same layer stay bitwise equal.
"""

from __future__ import annotations

import re

import numpy as np
from paddle import nn

from flashcp.models.config import ModelArgs
from flashcp.models.moe import MoE
from flashcp.models.moe_balance import update_bias

_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp$")


def moe_layers(model: nn.Layer) -> dict[int, MoE]:
    """This module's MoE layers by global decoder-layer index."""
    out: dict[int, MoE] = {}
    for name, layer in model.named_sublayers():
        m = _LAYER.match(name)
        if m is not None and isinstance(layer, MoE):
            out[int(m.group(1))] = layer
    return out


class RouterStats:
    """The packing, metrics and bias update of one rank (see the module docstring)."""

    def __init__(self, model: nn.Layer, args: ModelArgs) -> None:
        # trained MTP layers route tokens like any layer; frozen ones never run (and their
        # router bias must not move: it is exported as loaded)
        count = args.num_layers + (args.mtp_layers if args.mtp_trained else 0)
        self.layers = [i for i in range(count) if args.is_moe_layer(i)]
        self.experts = int(args.num_experts)
        self.local = moe_layers(model)
        self.rate = float(args.router_bias_update_rate)
        self.aux_on = float(args.router_aux_loss_coef) > 0
        self.capacity_on = float(args.moe_capacity_factor) > 0

    @property
    def size(self) -> int:
        """Length of the packed vector: loads `[layers, E]`, dropped, aux loss."""
        return len(self.layers) * self.experts + 2

    def local_vector(self) -> np.ndarray:
        """This rank's statistics since the last call (the layers' accumulators are reset)."""
        out = np.zeros(self.size, dtype=np.float64)
        loads = out[: len(self.layers) * self.experts].reshape(len(self.layers), self.experts)
        for row, index in enumerate(self.layers):
            layer = self.local.get(index)
            if layer is None:
                continue
            stats = layer.take_stats()
            loads[row] = stats.load
            out[-2] += stats.dropped
            out[-1] += stats.aux_loss
        return out

    def loads(self, reduced: np.ndarray) -> np.ndarray:
        """`[layers, E]` summed loads from the all-reduced vector."""
        return reduced[: len(self.layers) * self.experts].reshape(len(self.layers), self.experts)

    def metrics(self, reduced: np.ndarray) -> dict[str, float]:
        """The step's summarised expert-load statistics (module docstring); none for a
        model without MoE layers (e.g. `first_k_dense_replace` >= the layer count)."""
        if not self.layers:
            return {}
        loads = self.loads(reduced)
        mean = loads.mean(axis=1)
        ratio = np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)
        out = {
            "moe/max_over_mean_max": float(ratio.max()),
            "moe/max_over_mean_mean": float(ratio.mean()),
        }
        if self.aux_on:
            out["moe/aux_loss"] = float(reduced[-1])
        if self.capacity_on:
            routed = float(loads.sum())
            out["moe/drop_rate"] = float(reduced[-2]) / routed if routed > 0 else 0.0
        return out

    def update_biases(self, reduced: np.ndarray) -> None:
        """The bias update of the layers this rank holds (no-op when γ = 0)."""
        if self.rate <= 0:
            return
        loads = self.loads(reduced)
        for row, index in enumerate(self.layers):
            layer = self.local.get(index)
            if layer is not None:
                update_bias(layer.gate.e_score_correction_bias, loads[row], self.rate)
