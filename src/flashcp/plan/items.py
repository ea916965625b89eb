"""The device plan's vocabulary: every item a rank's plan reports and what it counts, the
GPU-only allowances, and `Moments`, the record of a stage's moments that the planner's parts
(`flashcp.plan.layer`, `head`, `forward`, `optimizer`) fill in."""

from __future__ import annotations

GIB = 2**30

ITEMS: tuple[str, ...] = (
    "params_trained",
    "params_frozen",
    "buffers",
    "gradients",
    "main_grads",
    "grad_shard",
    "master_weights",
    "optimizer_states",
    "dpo_reference",
    "inputs",
    "activations",
    "mtp_params",
    "mtp_activations",
    "layer_working_set",
    "attention_kv_gather",
    "logits_loss",
    "weight_grad_transient",
    "p2p_buffers",
    "ep_buffers",
    "grad_buckets",
    "zero_buffers",
    "optimizer_step_transient",
    "nccl_communicators",
    "fixed_overhead",
)
"""Every item a rank's plan reports (bytes live at the rank's peak; 0 when not live then)."""

ITEM_DOCS: dict[str, str] = {
    "params_trained": "trained parameters in train.param_dtype (LoRA: the adapters)",
    "params_frozen": "frozen parameters in train.param_dtype (LoRA: the base weights)",
    "buffers": "persistent buffers (MoE router selection bias), float32",
    "gradients": "parameter .grad of the trained parameters, in the storage dtype: those "
    "formed by this moment (released after each step; kept from an earlier micro-batch "
    "under train.grad_accum > 1 or pp > 1)",
    "main_grads": "float32 gradient accumulators (main_grad) when storage is bf16, formed "
    "by this moment as .grad",
    "grad_shard": "ZeRO-2 (gradient sharding): this rank's dp×cp shard of the float32 "
    "gradients, which replaces the full-size gradients and main_grads",
    "master_weights": "float32 master copies of trained parameters (bf16 storage or ZeRO), "
    "÷ dp×cp under parallel.shard_optimizer",
    "optimizer_states": "AdamW moments, 2 × float32 per trained element (÷ dp×cp sharded)",
    "dpo_reference": "the frozen DPO reference copy of the stage (not with LoRA)",
    "inputs": "token ids, positions, labels (int64) and masks of the step's micro-batches",
    "activations": "what autograd keeps for the micro-batches in flight (per recompute mode), "
    "stage inputs, rotary tables, CP masks, final norm",
    "mtp_params": "the multi-token-prediction layers' weights (last stage, model.mtp_layers) "
    "in train.param_dtype: trained with model.mtp_loss_weight > 0 (their gradients and "
    "optimizer state are in those items), else carried frozen",
    "mtp_activations": "what the trained MTP depths keep for backward (embedding, norms, "
    "eh_proj input, block per recompute mode, head), per micro-batch in flight",
    "layer_working_set": "one layer's backward: its activation gradients, and under recompute "
    "its re-run forward",
    "attention_kv_gather": "CP: full-sequence K/V all-gathered for one layer, dK/dV partial "
    "sums and reduce-scatter chunks",
    "logits_loss": "logits and the loss's softmax over the vocabulary (or one chunk of "
    "train.loss_chunk_tokens)",
    "weight_grad_transient": "a weight gradient being formed before it is accumulated (LM "
    "head / embedding), or the head weight upcast for compute (bf16 storage on CPU)",
    "p2p_buffers": "pipeline: the received activation gradient",
    "ep_buffers": "expert parallel: one MoE layer's all-to-all send / receive buffers (token "
    "rows to the experts' ranks and back, or their gradients), beyond the layer's own "
    "working set, which is not live at the same time",
    "grad_buckets": "gradient all-reduce bucket over cp/dp (parallel.grad_bucket_mb); under "
    "ZeRO-2 the float32 buckets being filled and reduce-scattered during backward",
    "zero_buffers": "ZeRO-1 flat reduce-scatter / all-gather buffers",
    "optimizer_step_transient": "pipeline clip's gradient copy and squared-norm temporaries",
    "nccl_communicators": "NCCL communicators this rank creates, one per process group and "
    "one per p2p pair, NCCL_COMMUNICATOR_BYTES each (GPU; 0 on CPU: gloo)",
    "fixed_overhead": "non-tensor device memory: CUDA context, library workspaces, allocator "
    "slack (GPU); 0 on CPU (the allocator counts tensors only)",
}

GPU_FIXED_BYTES = 1 * GIB
"""CUDA context and cuBLAS / cuDNN workspaces (not tensors). NCCL's buffers are planned per
communicator (`flashcp.plan.comms`, item ``nccl_communicators``): before they were, this was
2 GiB for both, so a job with one communicator plans as it did."""
GPU_FRAGMENTATION = 0.05
"""Allocator slack on GPU, as a fraction of the tensor bytes at the peak."""
OFFLOAD_IN_FLIGHT = 2

class Moments:
    """A stage's moments in the order they are planned: each one the stage's `base` items
    (persistent state, inputs, fixed overhead) with what that moment adds."""

    def __init__(self, base: dict[str, int]) -> None:
        self.base = dict(base)
        self.items: dict[str, dict[str, int]] = {}

    def add(self, name: str, **extra: float) -> None:
        """Record moment `name`: every item 0, then the base, then `extra` (bytes)."""
        items = dict.fromkeys(ITEMS, 0)
        items.update(self.base)
        items.update({k: int(v) for k, v in extra.items()})
        self.items[name] = items

    def add_gpu_slack(self) -> None:
        """GPU: the allocator's slack, `GPU_FRAGMENTATION` of each moment's tensor bytes, added
        to its ``fixed_overhead``."""
        for items in self.items.values():
            tensors = sum(v for k, v in items.items() if k != "fixed_overhead")
            items["fixed_overhead"] += int(GPU_FRAGMENTATION * tensors)
