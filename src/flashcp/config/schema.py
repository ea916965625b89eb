"""The typed config tree: one `kw_only` dataclass per YAML section, defaults and field docs.

A config file is data (YAML), read into these classes by `flashcp.config.load`. Each field's
docstring (the string under it) says what it does; `flashcp validate` and the loader's error
messages name fields by their dotted key (`train.lr`). The `model` section is not defined
here: it is `flashcp.models.ModelArgs` (optionally started from a preset, `model.preset`).

The sections a recipe adds (`lora`, `dpo`) are declared with the recipe
(`flashcp.config.recipe_spec.RecipeSpec`, the built-in ones in `flashcp.config.recipes`), not
here: they land in `Config.extras`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flashcp.attention import registry as cp_modes

REPORT_BACKENDS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "visualdl": ("visualdl", "visualdl"),
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboardX", "tensorboardX"),
}
"""`run.report_to` values → (module to import, pip package) they need (None: built in)."""

PREEMPT_SIGNALS: tuple[str, ...] = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
"""Names `run.preempt_signal` may take (besides null): SIGTERM always pre-empts, SIGINT
(Ctrl-C) stops at once, and Slurm sends SIGCONT before its SIGTERM."""

JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet",)
DATA_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
"""File name endings data.path may have (JSON Lines, Parquet); a directory holds such files."""

IGNORE_INDEX = -100
"""Label value of a position that has no target (end of a document, prompt, padding)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How the job's ranks are split: dp × pp × cp = number of processes."""

    dp: int = 1
    """Data-parallel degree: dp ranks train on different sequences, gradients are summed."""
    pp: int = 1
    """Pipeline-parallel degree: the model's layers are split into pp stages on pp ranks, run
    under a 1F1B schedule over the train.grad_accum micro-batches (which must be >= pp)."""
    pp_layers: list[int] | None = None
    """Decoder layers per pipeline stage, e.g. [3, 2] (sums to model.num_layers); null splits
    evenly, extra layers on the earliest stages (the last stage also runs the LM head)."""
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule: 1f1b (at most pp - stage micro-batches in flight) or gpipe (all
    forwards, then all backwards; more activation memory, same gradients)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split along its length over cp ranks."""
    cp_mode: str = cp_modes.DEFAULT_MODE
    """Sequence layout over the cp ranks, a mode of `flashcp.attention.registry`:
    dualchunk_allgather (rank r holds chunks r and 2cp-1-r), contiguous_allgather, or
    workload_balanced (chunk assignment computed from each batch's mask)."""
    pad: bool = False
    """Pad sequences up to the layout's multiple instead of requiring data.seq_len to divide."""
    grad_bucket_mb: float = 64.0
    """Gradients are summed over cp/dp in all-reduce buckets of at most this many MiB."""
    shard_optimizer: bool = False
    """ZeRO-1: shard the float32 master weights and both AdamW moments over the ranks that hold
    the same parameters (the dp × cp ranks of one pipeline stage). Gradients are then
    reduce-scattered in float32 buckets (parallel.grad_bucket_mb) instead of all-reduced, each
    rank updates its 1/(dp·cp) slice, and the updated slices are all-gathered into the
    parameters. Same losses as unsharded (to float32 rounding); checkpoints hold one optimizer
    shard per rank and load onto any dp × cp. With dp × cp = 1 there is nothing to shard.
    Under parallel.ep the expert parameters are sharded over the dp·cp/ep ranks that hold
    them."""
    shard_gradients: bool = False
    """ZeRO-2 (needs parallel.shard_optimizer: true): the float32 gradients are sharded too.
    Each bucket (parallel.grad_bucket_mb) is reduce-scattered into this rank's shard as soon
    as backward has produced all its gradients, and the full-size gradient is released, so a
    rank holds 1/(dp·cp) of the stage's float32 gradients (GLM-4-9B at 8 ranks: 4.7 instead of
    37.6 GiB) plus the buckets being filled. With train.grad_accum > 1 every micro-batch is
    reduce-scattered and added into the shard (the float32 sums run over the ranks, then the
    micro-batches: equal to ZeRO-1 up to rounding, bitwise with one micro-batch). Checkpoints
    are those of parallel.shard_optimizer."""
    ep: int = 1
    """Expert-parallel degree (MoE families: glm_moe, ernie4_5_moe, qwen3_moe): each MoE layer's
    routed experts are split over ep ranks, which send every token's rows to the rank holding its
    expert and back (all-to-all dispatch and combine). Rule (Megatron-Core / DeepSeek-V3): the ep
    ranks are carved from the dp × cp ranks of one pipeline stage, so ep must divide dp × cp, and
    model.num_experts must divide by ep. Rank j of a stage (j = dp_index · cp + cp_index) is ep rank
    j mod ep and holds experts [(j mod ep)·E/ep, (j mod ep + 1)·E/ep); ep <= cp keeps every ep group
    inside a cp group. Expert gradients are summed over the dp·cp/ep ranks holding the same experts,
    everything else over dp × cp as without ep. 1: every rank holds every expert."""

    @property
    def world_size(self) -> int:
        """dp × pp × cp: the number of processes the job needs."""
        return self.dp * self.pp * self.cp

    @property
    def seq_divisor(self) -> int:
        """data.seq_len must be a multiple of this (unless `pad`)."""
        return self.cp * cp_modes.get(self.cp_mode).chunks_per_rank


@dataclass(kw_only=True)
class AttentionConfig:
    """The attention mask of each document, and the kernel policy."""

    fa4_unavailable: Literal["error", "fallback"] | None = None
    """When FLAGS_flash_attn_version asks for a version this card (or call) cannot run - FA4
    without SM100 + CuTe kernels or beyond their mask limits, FA3 off SM90: fail (error), or fall
    back FA4 → FA3 → FA2 with one warning (fallback). null: the environment's
    FLASHCP_FA4_UNAVAILABLE, else error (`flashcp.fa_dispatch.resolve_policy`: config >
    environment > error, the one resolution preflight, every rank and `flashcp
    explain-dispatch` use)."""
    mask: Literal["causal", "sliding_window", "global_window", "prefix_lm"] = "causal"
    """The mask inside each packed document (every document of a sequence gets its own and sees
    no other; `flashcp.masks.DocumentMasking`): causal (each token sees the earlier tokens of
    its document), sliding_window (only the last attention.sliding_window of them, itself
    included), global_window (those, and the document's first attention.global_tokens tokens:
    global tokens / attention sinks, still causal) or prefix_lm (bidirectional over the
    document's prefix, causal after it; sft: the prefix is the prompt, every token before the
    first trained one; pretrain: the first attention.prefix_len tokens, which are then not
    trained on). Built on the whole sequence, so any parallel.cp gives the CP = 1 result. The
    dpo recipe keeps its share-question mask (causal only)."""
    sliding_window: int | None = None
    """Keys a token sees under attention.mask sliding_window / global_window, itself included
    (Hugging Face's and PaddleFormers' `sliding_window`; flash-attn's window_size w is w + 1),
    counted inside its own document."""
    global_tokens: int = 0
    """attention.mask global_window: the first tokens of each document that every later token
    of it sees, outside its window too (of a document continued from the previous row: the
    first tokens of its piece in this row)."""
    prefix_len: int | None = None
    """attention.mask prefix_lm with the pretrain recipe: the first prefix_len tokens of each
    document (its BOS included; at most all but its last token) form its bidirectional prefix
    and get no loss, since a token that sees the next one cannot be trained to predict it.
    null with sft (the prefix is each example's prompt)."""
    query_chunk: int = 0
    """Local query rows per attention kernel call (0 = all local rows in one call). > 0 (or
    attention.kv_chunk > 0) runs the CP mode's chunked attention
    (`flashcp.attention.allgather_kv_chunked`): partial results over key chunks merged exactly
    through their log-sum-exp, so the working set is bounded by the chunks instead of growing
    with the sequence (the float32 merge accumulators hold query_chunk rows). Also without CP."""
    kv_chunk: int = 0
    """Global keys gathered at once, and whose dK/dV are reduce-scattered at once, by the
    chunked attention (0 = all keys): a multiple of parallel.cp, each rank contributing
    kv_chunk / cp of its local rows (best a multiple of 128 per rank, FlashMask's key block)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where text comes from and how it becomes fixed-length training sequences."""

    path: str | None = None
    """The data: a JSON Lines (.jsonl/.json, one object per line) or Parquet (.parquet) file,
    or a directory whose files of one of those formats are read in name order (not its
    subdirectories); null = the small sets shipped with flashcp: an English corpus (pretrain),
    prompt/response pairs (sft), preference pairs (dpo). Rows are read lazily (see
    `flashcp.data.index`)."""
    tokenizer: str = "byte"
    """`byte` (256 byte ids + BOS/EOS/PAD), a Hugging Face `tokenizer.json` file, or a
    Hugging Face tokenizer/model directory (`tokenizer.json` + `tokenizer_config.json`): its
    special tokens and chat template are used (needed for `messages` data). With
    `model.from_pretrained` the default is that model directory (its tokenizer)."""
    format: str = "auto"
    """The rows' layout: `auto` (each row in the first format of its recipe whose fields it
    has) or one format for every row — sft: `messages`, `sharegpt` (`conversations` of
    from/value turns), `alpaca` (instruction/input/output), `paddleformers` (src/tgt),
    `prompt_response`; dpo: `preference` (prompt/chosen/rejected, strings or TRL messages),
    `ultrafeedback` (prompt string + chosen/rejected conversations), `implicit_prompt` (TRL:
    chosen/rejected conversations sharing the prompt turns), `paddleformers`
    (src/tgt/response/sort); pretrain: `text`. Chat formats are rendered with the tokenizer's
    chat template (docs/data.md)."""
    text_field: str = "text"
    """Field holding a document's text (pretrain recipe)."""
    prompt_field: str = "prompt"
    """Field of the prompt (sft: a string, its tokens get no loss; dpo: a string or a list of
    messages)."""
    response_field: str = "response"
    """Field of the response (sft recipe with prompt/response strings: only these tokens are
    trained on)."""
    messages_field: str = "messages"
    """Field of a conversation, a list of {"role", "content"} messages (sft recipe): rendered
    with the tokenizer's chat template, loss on the assistant turns only."""
    chosen_field: str = "chosen"
    """Field of the preferred answer (dpo): a string, or the assistant turn (a message or a
    one-message list) when the prompt is a list of messages."""
    rejected_field: str = "rejected"
    """Field of the dispreferred answer (dpo), like chosen_field."""
    on_bad_record: Literal["skip", "error"] = "skip"
    """A record that cannot be used (missing field, wrong type, empty answer, too long after
    truncation, not JSON): skip it — bad records are counted by reason and reported with
    their first rows in the start line and run_info.json — or stop before training, naming
    the row and the reason."""
    cache_dir: str | None = None
    """Where the `datasets` library keeps the Arrow cache of Parquet data (null: its default,
    $HF_DATASETS_CACHE or ~/.cache/huggingface/datasets)."""
    seq_len: int = 256
    """Tokens per training sequence (the global length, before context-parallel sharding)."""
    micro_batch_size: int = 1
    """Sequences per dp rank per forward/backward."""
    packing: bool = True
    """Pack documents back to back (document-causal mask); false = one document per sequence,
    truncated or padded to seq_len."""
    shuffle: bool = True
    """Shuffle document order each epoch (deterministically from train.seed)."""
    balance: Literal["none", "work"] = "work"
    """Packed data: `work` re-packs each window of data.balance_window steps so that every row
    of a step costs about the same modelled work (attention pairs from its mask plus linear
    work per token, `flashcp.cp.work`), and no dp rank or micro-batch waits for one that drew
    the long documents; the same documents, none dropped or duplicated, the plan the same for
    any split of the step's rows into dp ranks and micro-batches. `none`: first-fit in stream
    order. No effect with data.packing: false or one row per step (`flashcp.data.balance`)."""
    balance_window: int = 16
    """Steps of documents data.balance: work re-packs together: more lets the heaviest
    documents share a step (the long-tail case at 128K tokens needs ~16), and moves a document
    at most this many steps from its first-fit place."""


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation: steps, AdamW, schedule, precision, determinism."""

    steps: int = 100
    """Optimizer steps to run (the total, counting steps done before a resume). Set this or
    `epochs`, not both."""
    epochs: float | None = None
    """Passes over the training data instead of `steps`: the run takes
    ceil(epochs × rows per pass / rows per step) steps, counted from the data at the start
    (`flashcp.data.epochs`; rows per step = micro_batch_size × grad_accum × dp). null: run
    `steps`."""
    lr: float = 3.0e-4
    """Peak learning rate, reached after warmup."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; null: train.min_lr_ratio × train.lr (a
    floor that follows the peak, so any train.lr is valid as it is)."""
    min_lr_ratio: float = 0.1
    """The end of the cosine decay as a fraction of train.lr, when train.min_lr is null (0.1:
    down to 10 % of the peak, as Llama 2's cosine schedule decays)."""
    warmup_steps: int | None = None
    """Linear warmup from 0 to `lr` over this many steps; null = 10, or a tenth of the run if
    that is fewer, so a short run still decays (`flashcp.optim.lr.warmup_steps`). A value you
    set is kept, even one that leaves no decay (the start line then says so)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1.0e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (after summing over cp and dp) to this; 0 = no clipping."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    seed: int = 0
    """Seeds model init, data order and every RNG."""
    deterministic: bool = True
    """Set FLAGS_cudnn_deterministic=1 (the FlashAttention dispatch honours it) and seed all."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32 (CPU only: Paddle's
    FlashAttention/FlashMask GPU kernels exist for fp16/bf16 only) or bfloat16 O1 autocast (GPU
    only)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of the parameters, created directly in it: bfloat16 halves the weights'
    memory (frozen LoRA base weights, the DPO reference copy, trained weights). On CPU the
    layers upcast bf16 weights to float32 for compute (no bf16 matmul kernel there). LoRA
    adapters stay float32."""
    log_every: int = 1
    """Print a log line every this many steps (metrics.jsonl gets every step)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """NaN/Inf in the loss or gradients: stop with an error, or skip that step's update."""
    offload_activations: bool = False
    """Keep what recomputed layers keep for backward in HOST memory: each layer's input (and,
    under model.recompute refined, its stored attention output and LSE) is copied to the host
    after the layer's forward and back just before its backward, the previous layer's copy
    prefetched while a layer's backward runs (GPU: pinned buffers, copies on a side stream
    overlapping compute; CPU: numpy buffers). A pipeline stage also frees its output once
    sent. Device memory then no longer grows with layers × tokens; host memory does (per rank:
    layers × local tokens × hidden × the residual dtype's bytes, per micro-batch in flight).
    Same losses, bitwise. Needs model.recompute full or refined."""
    loss_chunk_tokens: int = 4096
    """The LM head and loss run over chunks of this many target tokens, each chunk's float32
    logits recomputed in backward, so no `[tokens, vocab]` logits tensor exists (at a 151k
    vocabulary a chunk of 4096 is 2.5 GB, the whole 16k local tokens ~10 GB per copy); the
    loss equals the unchunked one up to float summation order. 0 = unchunked (the full logits
    at once). Also used by the DPO answer log-probs."""

    @property
    def final_ratio(self) -> float:
        """The end of the cosine decay as a fraction of `lr`: `min_lr / lr`, or `min_lr_ratio`
        when `min_lr` is null (the one rule `flashcp.optim.lr` schedules with)."""
        return self.min_lr / self.lr if self.min_lr is not None else self.min_lr_ratio

    @property
    def final_lr(self) -> float:
        """The learning rate at the end of the decay: `min_lr`, or `min_lr_ratio × lr`."""
        return self.min_lr if self.min_lr is not None else self.min_lr_ratio * self.lr


@dataclass(kw_only=True)
class CheckpointConfig:
    """When to save and where to resume from."""

    every: int = 0
    """Save every this many steps; 0 = no periodic saves (the last step is still saved unless
    checkpoint.save_last is false)."""
    save_last: bool = True
    """Save the run's last step (train.steps, or where run.stop_after_steps stops it), so a
    finished run's weights are there for `flashcp export` and a stopped run resumes. false
    (with checkpoint.every 0): nothing is saved, and the start line says so."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints."""
    resume: str = "auto"
    """`auto` (newest intact checkpoint in run.output_dir, if any), `never`, or a checkpoint
    directory path."""
    init_from: str | None = None
    """A Hugging Face-layout safetensors checkpoint (file, or directory with
    `model.safetensors[.index.json]`) the model starts from; null = seeded random init, or the
    `model.from_pretrained` directory when that is set (another path is refused). A resumed run
    restores its own checkpoint instead."""
    async_: bool = field(default=False, metadata={"key": "async"})
    """`checkpoint.async` (a Python keyword, hence `async_` in code): at a save, each rank copies
    its state to host memory (pinned on GPU) and training goes on while a background thread
    writes it; the checkpoint appears (manifest last, atomically) once every rank's part is
    written. At most one save is in flight: the next waits for it (`flashcp.checkpoint.saving`).
    The host copy counts in the host plan (`flashcp plan`)."""
    fail_on_error: bool = False
    """A save that fails (disk full, permission denied, an I/O error) stops the job (exit 4);
    false: every rank logs the cause, the latest good checkpoint and the `keep_last` rotation
    stay as they were, and training continues (the next save retries)."""

    def due(self, step: int, last: int) -> bool:
        """Whether to save after optimizer step `step` of a run whose last step is `last`:
        every `every` steps, and the last one unless `save_last` is false."""
        return (self.every > 0 and step % self.every == 0) or (self.save_last and step == last)

    @property
    def saves(self) -> bool:
        """Whether the run writes any checkpoint."""
        return self.every > 0 or self.save_last

    def describe(self, last: int, where: str) -> str:
        """What the run will save and where, for the start line."""
        if not self.saves:
            return "no checkpoints (checkpoint.every 0, checkpoint.save_last false)"
        when = []
        if self.every > 0:
            when.append(f"every {self.every} steps")
        if self.save_last and not (self.every > 0 and last % self.every == 0):
            when.append(f"the last step ({last})")
        return f"checkpoints {' and '.join(when)} in {where} (newest {self.keep_last} kept)"


def config_key(f: Any) -> str:
    """The YAML key of dataclass field `f`: its name, or `metadata["key"]` for a field whose
    key is a Python keyword (`checkpoint.async` is the field `async_`)."""
    return str(f.metadata.get("key", f.name))


@dataclass(kw_only=True)
class RunConfig:
    """Where outputs go and which recipe runs."""

    output_dir: str = "runs/default"
    """Metrics, logs, checkpoints and the resolved config are written here."""
    overwrite: bool = False
    """Start over in output_dir: `flashcp train` first renames an earlier run there to
    `<output_dir>.old-<YYYYmmdd-HHMMSS>` (printed; nothing is deleted), then trains from scratch
    (or from a checkpoint.resume directory outside output_dir). Only `flashcp train` moves it:
    ranks started by paddle.distributed.launch directly refuse to start over an earlier run."""
    recipe: str = "pretrain"
    """Training recipe: `pretrain` (next-token loss on all text), `sft` (loss on responses) or
    `dpo` (preference pairs, share-question packing; see `flashcp.recipes.dpo`)."""
    device: Literal["auto", "cpu", "gpu"] = "auto"
    """Target device: auto (GPU if Paddle sees one), cpu or gpu. bfloat16 needs gpu; float32
    cannot run on gpu (see train.dtype)."""
    stop_after_steps: int = 0
    """Stop this run after this many steps (0: run to train.steps). The LR schedule still spans
    train.steps, so resuming later continues exactly as an uninterrupted run would."""
    report_to: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where rank 0 reports the step scalars (`flashcp.metrics.tracking`): `jsonl`
    (metrics.jsonl, always written), `visualdl` (VisualDL logs in output_dir/visualdl; installed
    with paddleformers), `wandb` (needs `pip install wandb`), `tensorboard` (event files in
    output_dir/tensorboard; needs `pip install tensorboardX`). Every backend gets the same
    scalars, named as in metrics.jsonl."""
    max_restarts: int = 0
    """Relaunch the job this many times at most when a rank dies, hangs (the collective
    watchdog) or a node is lost: `flashcp train` stops every rank and starts them again from
    the latest complete checkpoint, after `restart_backoff_s` (doubled each time). Never after
    a refused config (exit 2), a non-finite loss (3), a broken checkpoint (4), bad data (5) or
    a pre-emption (75). Each restart is a line of `restarts.jsonl` in output_dir. 0 = no
    restarts (`flashcp.launch.restart`)."""
    restart_backoff_s: float = 10.0
    """Seconds to wait before the first relaunch; each further one waits twice as long as the
    one before, at most 300 s."""
    preempt_grace_s: float = 120.0
    """Pre-emption: after SIGTERM or `preempt_signal` (to `flashcp train`, to one rank or to
    every rank) all ranks finish the step they are in, save a checkpoint and exit 75 within
    this many seconds; the same command then resumes. `flashcp train` stops the job when the
    time is up. Set it to the scheduler's grace period (Kubernetes
    terminationGracePeriodSeconds, the lead of Slurm's `--signal=USR1@SECONDS`)."""
    preempt_signal: str | None = "SIGUSR1"
    """A second signal that pre-empts like SIGTERM (Slurm `--signal=USR1@120`), by name:
    SIGUSR1, SIGUSR2, SIGHUP or SIGQUIT; null = SIGTERM only."""
    straggler_ratio: float = 1.2
    """A rank whose compute time per step (busy time less its waits in collectives) stays
    above this many times the median of its pipeline stage's ranks for `straggler_window`
    steps is named in the log and metrics (`straggler/rank`, `straggler/ratio`)."""
    straggler_window: int = 20
    """Steps in a row a rank must stay above `straggler_ratio` to be named. 0 = no straggler
    detection."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation during training (`flashcp.evaluation.evaluator`)."""

    path: str | None = None
    """Eval data in the training data's format (`data.*` fields and tokenizer apply); null =
    no evaluation."""
    every: int = 0
    """Evaluate every this many optimizer steps, and after the last step (train.steps);
    0 = only after the last step."""
    max_batches: int | None = None
    """At most this many eval batches, each the rows of one optimizer step (dp ×
    train.grad_accum × data.micro_batch_size sequences); null = one pass over the eval set,
    every row once."""


@dataclass(kw_only=True)
class HardwareConfig:
    """What the devices are: for the metrics derived from them and the memory plan."""

    peak_tflops: float | None = None
    """Peak dense TFLOP/s of ONE device in the compute dtype (e.g. 989 for an H100 SXM in
    bf16, 312 for an A100): the denominator of the `mfu` metric. null = no `mfu` reported."""
    memory_gib: float | None = None
    """Per-device memory budget in GiB the memory plan must fit (`flashcp plan`); null = no
    budget check (CPU configs). The GPU configs set 96 (an H20)."""
    memory_headroom: float = 0.05
    """Fraction of `memory_gib` the plan keeps free, beyond its own allowances (CUDA context,
    5 % allocator slack, NCCL communicators): `flashcp plan --longest`, `validate` and `train`
    fit the plan into memory_gib × (1 − memory_headroom). 0.05 is what Paddle's allocator
    itself keeps back (`fraction_reserve_gpu_memory`, 5 % of the free device memory,
    paddle/phi/backends/gpu/gpu_info.cc); its default auto_growth strategy "may lead to more
    memory fragmentation" (paddle/common/flags.cc). 0 = fit to the last byte."""
    host_memory_gib: float | None = None
    """Host (CPU) memory budget in GiB of ONE node that the host plan must fit (`flashcp
    plan`): what the ranks on a node keep in host memory — activations moved there by an
    offload, pinned staging buffers, checkpoint arrays being written, each process's own
    memory — summed over the node's ranks. null = no host budget check."""
    host_memory_reserve: float = 0.1
    """Fraction of `host_memory_gib` the host plan leaves to the operating system, its page
    cache (data files, checkpoint writes) and what the plan does not count; the ranks' planned
    host memory must fit host_memory_gib × (1 − host_memory_reserve). An allowance, not a
    measurement; 0 = fit to the last byte."""
    gpus_per_node: int = 8
    """Ranks (devices) per node, for the host plan: a job's ranks fill nodes of this many in
    rank order. `flashcp train --nnodes N` and `flashcp validate --nnodes N` use the launch's
    dp·pp·cp / N instead."""
    host_link_gb_per_s: float | None = None
    """Host↔device copy bandwidth of ONE device in GB/s (10^9 bytes per second, one direction),
    for the plan's step-time estimate: whether copying offloaded activations would stall the
    compute. An H20 sits on PCIe Gen5 x16 (63 GB/s per direction before protocol overhead); the
    GPU configs state what they assume. null = no copy-time estimate."""
    checkpoint_write_gb_per_s: float | None = None
    """Write bandwidth of ONE checkpoint writer to the checkpoint storage in GB/s (10^9 bytes
    per second): with it `flashcp train` says at start when `run.preempt_grace_s` cannot fit a
    step and the pre-emption save of the planned checkpoint bytes. null = judged from the first
    save's measured time instead."""


@dataclass(kw_only=True)
class DebugConfig:
    """Diagnostics for tests and bug hunts (off by default)."""

    dump_grads: bool = False
    """Rank 0 writes the summed gradients of every step to output_dir/grads/step_N.safetensors
    (before clipping), so runs with different parallel layouts can be compared."""


SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "attention": AttentionConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "run": RunConfig,
    "eval": EvalConfig,
    "hardware": HardwareConfig,
    "debug": DebugConfig,
}
"""Core sections besides `model`, in file order."""


@dataclass(kw_only=True)
class Config:
    """A whole run: the model plus every section, resolved and typed."""

    model: Any
    """`flashcp.models.ModelArgs` (kept untyped here so the schema imports no Paddle)."""
    model_preset: str | None = None
    """The preset the model section started from, if any (informational)."""
    model_from_pretrained: str | None = None
    """`model.from_pretrained`: the Hugging Face model directory whose config.json gave the
    model section (and whose weights `checkpoint.init_from` then loads), if any."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    extras: dict[str, Any] = field(default_factory=dict)
    """Sections added by recipes (`flashcp.config.recipe_spec.RecipeSpec.sections`), by
    name."""
    source: str | None = None
    """The file this config was read from (None when built in code)."""
    overrides: tuple[str, ...] = ()
    """The `key=value` overrides applied on top of the file."""
    notes: tuple[str, ...] = ()
    """What loading decided that the user should hear (e.g. a command-line
    `model.from_pretrained` replacing the file's `model.preset`): the start line and `flashcp
    validate` print them."""
