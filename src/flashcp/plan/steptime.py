"""A step-time estimate beside the memory plan: FLOPs at a stated utilisation, and whether
copying offloaded activations between host and device would stall the compute.

Compute: the model FLOPs of one optimizer step are `flashcp.metrics.flops.flops_per_token`
(the `mfu` metric's formula) times the step's tokens, with the attention counted as the run's
mask computes it over one sequence-long document (`document_keys`: for the default causal mask
half the full count, which at millions of tokens is most of the step; under a sliding window
about the window per token; an sft prefix-LM's prompts, unknown here, as causal), spread
evenly over the job's devices. At `hardware.peak_tflops` per device that is
a lower bound; at a stated model-FLOPs utilisation (`mfu`, default `DEFAULT_MFU`), stretched by
the pipeline's fill and drain ((pp - 1) / (micro-batches + pp - 1) of the step idle), an
estimate.
Recompute's extra forward is not model FLOPs: it is part of what keeps the utilisation below 1.

Copies (activation offload, `flashcp.plan.features`): per micro-batch each layer's kept input
goes to host during its forward and comes back, prefetched, during the backward of the layer
above it, so each copy overlaps one layer's compute: the forward of the layer whose input it
is (device→host), the backward of the layer above (host→device), which under full recompute
re-runs that layer's forward too. At `hardware.host_link_gb_per_s` per device (one direction)
a copy longer than the compute it overlaps stalls the step by the difference. Layer compute
is estimated from the same formula per layer (the layer's matmul weights and its attention at
the stated utilisation), so the comparison holds whatever the utilisation turns out to be as
long as copies and compute slow down alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashcp.config.device import compute_dtype, resolve_device
from flashcp.config.schema import Config
from flashcp.data.packing import document_masking
from flashcp.metrics.flops import document_keys, flops_per_token
from flashcp.pipeline.split import split_layers
from flashcp.plan import activations as act
from flashcp.plan.features import Features, features_of
from flashcp.plan.params import layer_parameters

DEFAULT_MFU = 0.4
"""Model-FLOPs utilisation the estimate assumes unless told otherwise: a stated figure, not a
measurement (long-sequence bf16 training on Hopper-class GPUs reports 35–55 %)."""


@dataclass(frozen=True)
class LayerTime:
    """One decoder layer, one micro-batch, on one rank: compute and offload copy times (s)."""

    index: int
    forward_s: float
    backward_s: float
    """The layer's backward, including recompute's re-run of its forward."""
    copy_bytes: int
    """Bytes offloaded per direction (its input; 0 without offload)."""
    copy_s: float | None
    """Time of one copy at the host link's bandwidth (None: no bandwidth given)."""

    @property
    def stall_s(self) -> float:
        """How long the copies of this layer's input would stall the step (0: hidden)."""
        if self.copy_s is None or not self.copy_bytes:
            return 0.0
        return max(0.0, self.copy_s - self.forward_s) + max(0.0, self.copy_s - self.backward_s)


@dataclass
class StepTime:
    """The estimate for one optimizer step (see the module docstring)."""

    flops: float
    """Model FLOPs of the whole job's step."""
    devices: int
    peak_tflops: float | None
    mfu: float
    link_gb_per_s: float | None
    micro_batches: int
    """Micro-batches each rank runs per step."""
    layers: list[LayerTime] = field(default_factory=list)
    stages: int = 1
    """Pipeline stages: a step also waits for the pipeline to fill and drain."""
    """The most loaded stage's layers (stage 0's under an even split)."""
    mask: str = "causal"
    """The attention mask whose work is counted (`attention.mask`, `DocumentMasking.describe`)."""

    @property
    def flops_per_device(self) -> float:
        return self.flops / max(self.devices, 1)

    @property
    def seconds_at_peak(self) -> float | None:
        """The lower bound: every device at `peak_tflops`."""
        if not self.peak_tflops:
            return None
        return self.flops_per_device / (self.peak_tflops * 1e12)

    @property
    def bubble(self) -> float:
        """The pipeline's idle fraction, (pp - 1) / (micro-batches + pp - 1) (1F1B and GPipe
        alike): the step takes 1 / (1 - bubble) times its compute."""
        return (self.stages - 1) / (self.micro_batches + self.stages - 1)

    @property
    def seconds(self) -> float | None:
        """At the stated utilisation, stretched by the pipeline bubble, plus any offload
        stall."""
        low = self.seconds_at_peak
        if low is None:
            return None
        return low / self.mfu / (1 - self.bubble) + self.stall_s

    @property
    def stall_s(self) -> float:
        """Offload stalls of one step (every micro-batch, every layer of the stage)."""
        return self.micro_batches * sum(x.stall_s for x in self.layers)

    @property
    def copy_hidden(self) -> bool | None:
        """Whether every copy fits under the compute it overlaps (None: nothing to say)."""
        if not any(x.copy_bytes for x in self.layers) or self.link_gb_per_s is None:
            return None
        return self.stall_s == 0.0

    def to_json(self) -> dict[str, Any]:
        worst = max(self.layers, key=lambda x: (x.copy_s or 0) / max(x.forward_s, 1e-30),
                    default=None)  # fmt: skip
        return {
            "flops_per_step": self.flops,
            "flops_per_device": self.flops_per_device,
            "devices": self.devices,
            "peak_tflops": self.peak_tflops,
            "mfu": self.mfu,
            "seconds_at_peak": self.seconds_at_peak,
            "seconds": self.seconds,
            "host_link_gb_per_s": self.link_gb_per_s,
            "offload_stall_s": self.stall_s,
            "pipeline_bubble": self.bubble,
            "copy_hidden": self.copy_hidden,
            "layer": None if worst is None else {
                "index": worst.index, "forward_s": worst.forward_s,
                "backward_s": worst.backward_s, "copy_bytes": worst.copy_bytes,
                "copy_s": worst.copy_s,
            },
        }  # fmt: skip


def layer_flops(args: Any, index: int, tokens: int, keys: float) -> float:
    """Forward model FLOPs of decoder layer `index` over `tokens` local tokens each attending
    `keys` keys: 2 per matmul weight a token multiplies (an MoE layer: its router, shared
    experts and top-k routed experts) and 4·K·H·d for attention."""
    weights = 0
    for spec in layer_parameters(args, index):
        if len(spec.shape) == 2:
            weights += spec.numel
        elif spec.stacked:  # a token multiplies its top-k of the E stacked experts
            weights += spec.numel * args.num_experts_per_tok // args.num_experts
    attention = 4.0 * keys * args.num_heads * args.head_size
    return tokens * (2.0 * weights + attention)


def estimate(
    cfg: Config,
    *,
    mfu: float = DEFAULT_MFU,
    features: Features | None = None,
    peak_tflops: float | None = None,
    link_gb_per_s: float | None = None,
    device: str | None = None,
) -> StepTime:
    """The step-time estimate of `cfg` (module docstring); `peak_tflops` and `link_gb_per_s`
    default to `hardware.peak_tflops` and `hardware.host_link_gb_per_s`, `device` to
    `run.device` (it sets the compute dtype, hence the bytes a copy moves)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    f = features_of(cfg) if features is None else features
    args, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    seq = d.seq_len
    prefix = cfg.attention.prefix_len or 0  # pretrain prefix_lm; sft prompts: unknown here
    keys = document_keys(document_masking(cfg), seq, prefix)
    lora = cfg.extras.get("lora") is not None
    dpo = cfg.run.recipe == "dpo"
    per_token = flops_per_token(args, seq, lora=lora, reference=dpo, keys=keys)
    tokens = p.dp * t.grad_accum * d.micro_batch_size * seq
    peak = peak_tflops if peak_tflops is not None else cfg.hardware.peak_tflops
    link = link_gb_per_s if link_gb_per_s is not None else cfg.hardware.host_link_gb_per_s
    local = d.micro_batch_size * seq // p.cp
    rate = (peak or 0.0) * 1e12 * mfu
    stage = split_layers(args.num_layers, p.pp, p.pp_layers)[0]
    device = device or resolve_device(cfg)
    dt = act.Dtypes.of(compute_dtype(cfg, device, check=False), t.param_dtype, device,
                       f.residual_dtype)  # fmt: skip
    kept = act.layer_output(args)
    if args.recompute == "refined":
        kept = kept + act.refined_extra(args)
    layers = []
    for index in stage:
        fwd = layer_flops(args, index, local, keys)
        # backward: activation and weight gradients (2× forward; LoRA: no weight gradients of
        # the frozen weights, attention's backward still 2×), plus recompute's re-run forward
        weights_fwd = fwd - local * 4.0 * keys * args.num_heads * args.head_size
        bwd = 2 * (fwd - weights_fwd) + (1 if lora else 2) * weights_fwd
        if args.recompute != "none":
            bwd += fwd
        copy = local * kept.bytes(dt) if f.offload_activations else 0
        layers.append(LayerTime(
            index=index,
            forward_s=fwd / rate if rate else 0.0,
            backward_s=bwd / rate if rate else 0.0,
            copy_bytes=int(copy),
            copy_s=copy / (link * 1e9) if link and copy else None,
        ))  # fmt: skip
    micro = t.grad_accum
    masking = document_masking(cfg).describe()
    return StepTime(per_token * tokens, p.world_size, peak, mfu, link, micro, layers, p.pp,
                    mask=masking)  # fmt: skip


