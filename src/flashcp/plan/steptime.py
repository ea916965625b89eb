"""A step-time estimate beside the memory plan, on one basis: the FLOPs each part of a step
executes, at the hardware utilisation a stated MFU implies.

Two counts per part of one micro-batch on one rank (a decoder layer, a trained MTP depth, the
LM head), with T local tokens each attending K keys on average under the run's mask
(`attention.mask`: one causal document per row by default, K = (S + 1) / 2; about the window
under a sliding window; packed documents, `flashcp.plan.documents`, far fewer; an sft
prefix-LM's prompts, unknown here, as causal):

* model FLOPs — the `mfu` metric's convention (`flashcp.cp.work.WorkModel`): 6 per matmul
  weight and token (4 with LoRA's frozen weights), 12·H·d per visible (query, key) pair, + 2
  and + 4 for DPO's reference pass. Recompute is not model work;
* executed FLOPs — what the kernels run: the forward (2·W·T for the matmuls, 4·H·d per pair for
  attention), the backward (2× the matmuls' forward, 1× without weight gradients under LoRA;
  `ATTENTION_BACKWARD` × the attention's forward: FlashAttention's backward recomputes the
  scores and runs five matmuls to the forward's two), recompute's re-run forward (full: the
  whole layer; refined: all but the attention core, whose output it keeps), tiling's extra
  re-run of the token-wise parts (`flashcp.models.tiling`: three forwards instead of two), the
  chunked loss's re-run of each chunk's head, and the DPO reference forward.

At `hardware.peak_tflops` per device and a stated MFU (`mfu`, default `DEFAULT_MFU`) the job
runs its model FLOPs at peak × MFU, so it executes at peak × MFU × executed / model — the
hardware utilisation (HFU) the MFU implies. Every part's forward and backward time is its
executed FLOPs at that rate, so the parts of a stage, times its micro-batches, ARE the
stage's compute time; the busiest stage sets the step, stretched by the pipeline's fill and
drain ((pp - 1) / (micro-batches + pp - 1) of the step idle). With one stage the step is exactly
the model FLOPs per device at peak × MFU.

Copies (activation offload, `flashcp.plan.features`): per micro-batch each layer's kept input
goes to host during its forward and comes back, prefetched, during the backward of the layer
above it, so each copy overlaps one layer's compute: the forward of the layer whose input it
is (device→host), the backward of the layer above (host→device). At
`hardware.host_link_gb_per_s` per device (one direction) a copy longer than the compute it
overlaps stalls the step by the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from flashcp.config.device_rule import compute_dtype, resolve_device
from flashcp.config.schema import Config
from flashcp.cp.work import (
    ATTENTION_REFERENCE,
    ATTENTION_TRAIN,
    LINEAR_LORA,
    LINEAR_REFERENCE,
    LINEAR_TRAIN,
)
from flashcp.data.packing import document_masking
from flashcp.models.families.inventory import (
    head_weights,
    layer_matmul_weights,
    mtp_projection_weights,
    trained_mtp_depths,
)
from flashcp.pipeline.split import split_layers
from flashcp.plan import activations as act
from flashcp.plan.counts import Dtypes
from flashcp.plan.documents import DocumentMix, keys_per_token
from flashcp.plan.features import Features, features_of

DEFAULT_MFU = 0.4
"""Model-FLOPs utilisation the estimate assumes unless told otherwise: a stated figure, not a
measurement (long-sequence bf16 training on Hopper-class GPUs reports 35–55 %)."""
ATTENTION_BACKWARD = 2.5
"""Executed FLOPs of the attention backward over its forward: FlashAttention recomputes the
scores QKᵀ and runs dV = PᵀdO, dP = dO·Vᵀ, dQ = dS·K and dK = dSᵀ·Q — five matmuls to the
forward's two (QKᵀ, PV) (Dao, FlashAttention-2, arXiv 2307.08691, §3.1.2)."""


@dataclass(frozen=True)
class PartTime:
    """One part of a micro-batch's step on one rank (a decoder layer, an MTP depth, the LM
    head): its FLOPs, its compute times at the estimate's rate, and its offload copy."""

    name: str
    """`layer i`, `mtp d` or `head`."""
    index: int | None
    """The decoder layer's index (None for the head)."""
    model_flops: float
    forward_flops: float
    backward_flops: float
    """Executed: gradients, attention's backward, recompute's and tiling's re-runs."""
    forward_s: float
    backward_s: float
    copy_bytes: int = 0
    """Bytes offloaded per direction (a layer's input; 0 without offload)."""
    copy_s: float | None = None
    """Time of one copy at the host link's bandwidth (None: no bandwidth given)."""

    @property
    def executed_flops(self) -> float:
        return self.forward_flops + self.backward_flops

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def stall_s(self) -> float:
        """How long the copies of this part's input would stall the step (0: hidden)."""
        if self.copy_s is None or not self.copy_bytes:
            return 0.0
        return max(0.0, self.copy_s - self.forward_s) + max(0.0, self.copy_s - self.backward_s)


LayerTime = PartTime
"""The name this record had when it held decoder layers only."""


@dataclass
class StepTime:
    """The estimate for one optimizer step (see the module docstring)."""

    flops: float
    """Model FLOPs of the whole job's step."""
    executed: float
    """Executed FLOPs of the whole job's step."""
    devices: int
    peak_tflops: float | None
    mfu: float
    link_gb_per_s: float | None
    micro_batches: int
    """Micro-batches each rank runs per step."""
    parts: list[PartTime] = field(default_factory=list)
    """The busiest stage's parts, per micro-batch and rank."""
    stages: int = 1
    """Pipeline stages: a step also waits for the pipeline to fill and drain."""
    stage_executed: list[float] = field(default_factory=list)
    """Each stage's executed FLOPs per rank and step."""
    keys: float = 0.0
    """Keys a token attends on average."""
    documents: str = "one causal document per row"
    mask: str = "causal"
    """The attention mask whose work is counted (`attention.mask`, `DocumentMasking.describe`)."""

    @property
    def layers(self) -> list[PartTime]:
        """The decoder layers (and MTP depths) among `parts`."""
        return [x for x in self.parts if x.index is not None]

    @property
    def flops_per_device(self) -> float:
        return self.flops / max(self.devices, 1)

    @property
    def executed_per_device(self) -> float:
        return self.executed / max(self.devices, 1)

    @property
    def executed_over_model(self) -> float:
        return self.executed / self.flops if self.flops else 1.0

    @property
    def hfu(self) -> float:
        """The hardware utilisation the stated MFU implies: executed FLOPs at the rate the
        model FLOPs run at MFU."""
        return self.mfu * self.executed_over_model

    @property
    def rate(self) -> float | None:
        """Executed FLOP/s of one device (None: no peak given)."""
        return self.peak_tflops * 1e12 * self.hfu if self.peak_tflops else None

    @property
    def seconds_at_peak(self) -> float | None:
        """The lower bound: the busiest stage's compute at 100 % MFU."""
        return self.compute_s * self.mfu if self.rate else None

    @property
    def bubble(self) -> float:
        """The pipeline's idle fraction, (pp - 1) / (micro-batches + pp - 1) (1F1B and GPipe
        alike): the step takes 1 / (1 - bubble) times its compute."""
        return (self.stages - 1) / (self.micro_batches + self.stages - 1)

    @property
    def compute_s(self) -> float:
        """The busiest stage's compute per step: its parts' times × its micro-batches (0
        without a peak)."""
        rate = self.rate
        if not rate or not self.stage_executed:
            return 0.0
        return max(self.stage_executed) / rate

    @property
    def seconds(self) -> float | None:
        """The busiest stage's compute, stretched by the pipeline bubble, plus any offload
        stall."""
        if not self.rate:
            return None
        return self.compute_s / (1 - self.bubble) + self.stall_s

    @property
    def stall_s(self) -> float:
        """Offload stalls of one step (every micro-batch, every layer of the stage)."""
        return self.micro_batches * sum(x.stall_s for x in self.parts)

    @property
    def copy_hidden(self) -> bool | None:
        """Whether every copy fits under the compute it overlaps (None: nothing to say)."""
        if not any(x.copy_bytes for x in self.parts) or self.link_gb_per_s is None:
            return None
        return self.stall_s == 0.0

    def to_json(self) -> dict[str, Any]:
        worst = max(self.layers, key=lambda x: (x.copy_s or 0) / max(x.forward_s, 1e-30),
                    default=None)  # fmt: skip
        return {
            "flops_per_step": self.flops,
            "flops_per_device": self.flops_per_device,
            "executed_flops_per_step": self.executed,
            "executed_over_model": self.executed_over_model,
            "devices": self.devices,
            "peak_tflops": self.peak_tflops,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "keys_per_token": self.keys,
            "documents": self.documents,
            "seconds_at_peak": self.seconds_at_peak,
            "seconds": self.seconds,
            "host_link_gb_per_s": self.link_gb_per_s,
            "offload_stall_s": self.stall_s,
            "pipeline_bubble": self.bubble,
            "copy_hidden": self.copy_hidden,
            "parts": [
                {"name": x.name, "model_flops": x.model_flops, "forward_flops": x.forward_flops,
                 "backward_flops": x.backward_flops, "forward_s": x.forward_s,
                 "backward_s": x.backward_s}
                for x in self.parts
            ],
            "layer": None if worst is None else {
                "index": worst.index, "forward_s": worst.forward_s,
                "backward_s": worst.backward_s, "copy_bytes": worst.copy_bytes,
                "copy_s": worst.copy_s,
            },
        }  # fmt: skip


def layer_flops(args: Any, index: int, tokens: int, keys: float) -> float:
    """Forward FLOPs of decoder layer `index` over `tokens` local tokens each attending `keys`
    keys: 2 per matmul weight a token multiplies (the family's `layer_matmul_weights`) and
    4·K·H·d for attention."""
    return tokens * (2.0 * layer_matmul_weights(args, index) + 4.0 * keys * args.num_heads
                     * args.head_size)  # fmt: skip


class _Part(NamedTuple):
    name: str
    index: int | None
    model: float
    forward: float
    backward: float


@dataclass(frozen=True)
class _Basis:
    """What every part's FLOPs depend on besides its weights."""

    tokens: int
    keys: float
    head_dims: float
    """H·d: query heads × head dim."""
    lora: bool
    dpo: bool
    recompute: str
    tiled: bool
    chunked_loss: bool

    def part(self, name: str, index: int | None, weights: float, attention: bool) -> _Part:
        """The FLOPs of a part with `weights` matmul weights per token and (`attention`) one
        attention: a decoder block (`index`: its layer) or a head (`index` None)."""
        T = self.tokens
        mm = 2.0 * weights * T
        att = 4.0 * self.keys * T * self.head_dims if attention else 0.0
        model = (LINEAR_LORA if self.lora else LINEAR_TRAIN) / 2 * mm + ATTENTION_TRAIN / 4 * att
        forward = mm + att
        backward = (1.0 if self.lora else 2.0) * mm + ATTENTION_BACKWARD * att
        if index is not None:  # a decoder block: recompute's and tiling's re-runs
            if self.recompute == "full":
                backward += mm + att
            elif self.recompute == "refined":
                backward += mm
            if self.tiled:
                backward += mm
        elif self.chunked_loss:  # the head: each chunk's logits again in backward
            backward += mm
        if self.dpo:  # the reference pass, a forward without gradients
            model += LINEAR_REFERENCE / 2 * mm + ATTENTION_REFERENCE / 4 * att
            forward += mm + att
        return _Part(name, index, model, forward, backward)


def estimate(
    cfg: Config,
    *,
    mfu: float = DEFAULT_MFU,
    features: Features | None = None,
    peak_tflops: float | None = None,
    link_gb_per_s: float | None = None,
    device: str | None = None,
    docs: DocumentMix | None = None,
) -> StepTime:
    """The step-time estimate of `cfg` (module docstring); `peak_tflops` and `link_gb_per_s`
    default to `hardware.peak_tflops` and `hardware.host_link_gb_per_s`, `device` to
    `run.device` (it sets the compute dtype, hence the bytes a copy moves); `docs`: the
    documents packed into each row (None: one causal document per row)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    f = features_of(cfg) if features is None else features
    args, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    seq = d.seq_len
    masking = document_masking(cfg)
    prefix = cfg.attention.prefix_len or 0  # pretrain prefix_lm; sft prompts: unknown here
    keys = keys_per_token(docs, seq, masking, prefix)
    local = d.micro_batch_size * seq // p.cp
    basis = _Basis(
        tokens=local,
        keys=keys,
        lora=cfg.extras.get("lora") is not None,
        dpo=cfg.run.recipe == "dpo",
        recompute=args.recompute,
        head_dims=float(args.num_heads * args.head_size),
        tiled=f.tile_tokens > 0 and args.recompute != "none",
        chunked_loss=t.loss_chunk_tokens > 0,
    )
    stages = split_layers(args.num_layers, p.pp, p.pp_layers)
    per_stage: list[list[_Part]] = []
    for s, layers in enumerate(stages):
        parts = [basis.part(f"layer {i}", i, layer_matmul_weights(args, i), True) for i in layers]
        if s == p.pp - 1:
            for depth in range(trained_mtp_depths(args)):
                index = args.num_layers + depth
                weights = layer_matmul_weights(args, index) + mtp_projection_weights(args)
                parts.append(basis.part(f"mtp {depth}", index, weights, True))
                parts.append(basis.part(f"mtp {depth} head", None, head_weights(args), False))
            parts.append(basis.part("head", None, head_weights(args), False))
        per_stage.append(parts)
    micro = t.grad_accum
    ranks = p.dp * p.cp  # the ranks of one stage
    model = sum(x.model for parts in per_stage for x in parts) * micro * ranks
    stage_executed = [sum(x.forward + x.backward for x in parts) * micro for parts in per_stage]
    executed = sum(stage_executed) * ranks
    peak = peak_tflops if peak_tflops is not None else cfg.hardware.peak_tflops
    link = link_gb_per_s if link_gb_per_s is not None else cfg.hardware.host_link_gb_per_s
    est = StepTime(model, executed, p.world_size, peak, mfu, link, micro, [], p.pp,
                   stage_executed, keys,
                   "one causal document per row" if docs is None else docs.name,
                   masking.describe())  # fmt: skip
    rate = est.rate or 0.0
    busiest = max(range(p.pp), key=lambda s: stage_executed[s])
    device = device or resolve_device(cfg)
    dt = Dtypes.of(compute_dtype(cfg, device, check=False), t.param_dtype, device,
                       f.residual_dtype)  # fmt: skip
    kept = act.layer_output(args)
    if args.recompute == "refined":
        kept = kept + act.refined_extra(args)
    for name, index, m, fwd, bwd in per_stage[busiest]:
        copy = local * kept.bytes(dt) if f.offload_activations and index is not None and (
            index < args.num_layers) else 0  # fmt: skip
        est.parts.append(PartTime(
            name=name, index=index, model_flops=m, forward_flops=fwd, backward_flops=bwd,
            forward_s=fwd / rate if rate else 0.0, backward_s=bwd / rate if rate else 0.0,
            copy_bytes=int(copy), copy_s=copy / (link * 1e9) if link and copy else None,
        ))  # fmt: skip
    return est
