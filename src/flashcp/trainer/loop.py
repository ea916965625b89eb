"""The training loop: one `Trainer` per process, the same code for 1 or N ranks.

One optimizer step (`Trainer.train_step`):

1. `TrainData.next_step()` gives this dp rank's `grad_accum` micro-batches of FULL sequences
   (labels already shifted, global causal-document mask built).
2. Each is sharded to this cp rank (`shard_batch` with the step's `Assignment`; for
   `workload_balanced` the assignment is computed from the batch's global mask).
3. The number of target tokens is summed over cp and dp: the loss of every micro-batch is
   `sum of local token cross-entropies / GLOBAL target count`, so the job's loss and gradients
   are those of one big batch, whatever the layout (CP=1 and CP=N agree to float rounding).
4. Backward per micro-batch (gradients accumulate); the loss and per-rank non-finite flags are
   all-reduced, then the gradients are summed (bucketed all-reduce) over cp, then dp.
5. NaN/Inf: `train.on_nonfinite: stop` raises `NonFiniteError` naming the step and rank(s) on
   every rank at once; `skip` drops the update and logs it.
6. AdamW step (clipping the now-global gradient norm), LR schedule step, metrics on rank 0,
   checkpoint every `checkpoint.every` steps.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import paddle
import paddle.nn.functional as F

from flashcp import dispatch
from flashcp.config import IGNORE_INDEX, Config, config_hash, diff_dicts, hashed_dict, to_yaml
from flashcp.cp import make_assignment
from flashcp.cp.layout import Assignment
from flashcp.data import Batch, LocalBatch, TrainData, shard_batch
from flashcp.distributed import ParallelDims, ParallelGroups, barrier, build_groups
from flashcp.trainer import checkpoint as ckpt
from flashcp.trainer.metrics import MetricsWriter, StepMetrics, peak_memory_gib
from flashcp.trainer.optim import build_optimizer, build_scheduler
from flashcp.trainer.parallel import all_reduce_values, squared_norm, sync_grads, trainable
from flashcp.trainer.state import (
    load_model_arrays,
    load_optimizer_arrays,
    model_arrays,
    optimizer_arrays,
    rng_state,
    set_rng_state,
)

GRADS_DIR = "grads"
SAVE_BARRIER_TIMEOUT = 3600.0
"""Other ranks wait this long (s) for rank 0 to write a checkpoint."""


class NonFiniteError(RuntimeError):
    """NaN/Inf in the loss or gradients (train.on_nonfinite: stop)."""


@dataclass
class TrainResult:
    """What `Trainer.fit` did."""

    start_step: int
    final_step: int
    metrics: list[StepMetrics] = field(default_factory=list)
    resumed_from: Path | None = None


def resolve_device(cfg: Config) -> str:
    """`cpu` or `gpu` for `run.device` (auto: GPU when Paddle sees one); checks the dtype."""
    has_gpu = bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
    wanted = cfg.run.device
    if wanted == "gpu" and not has_gpu:
        raise RuntimeError(
            "run.device is gpu but Paddle sees no GPU here (CPU build or no device): set "
            "run.device: cpu (or auto)"
        )
    device = "gpu" if wanted == "gpu" or (wanted == "auto" and has_gpu) else "cpu"
    if cfg.train.dtype == "bfloat16" and device != "gpu":
        raise RuntimeError(
            "train.dtype bfloat16 needs a GPU and this run is on CPU: set train.dtype=float32"
        )
    return device


def set_determinism(cfg: Config) -> None:
    """Seed Python, numpy and Paddle; in deterministic mode set the cuDNN/embedding flags.

    The flags go both to `paddle.set_flags` (GPU builds read them there) and to the environment
    (the CPU build refuses set_flags for them; `flashcp.dispatch` then reads the environment), so
    the FlashAttention dispatch sees deterministic mode either way.
    """
    seed = cfg.train.seed
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)
    if not cfg.train.deterministic:
        return
    flags = {dispatch.FLAG_DETERMINISTIC: "1", "FLAGS_embedding_deterministic": "1"}
    for name, value in flags.items():
        os.environ[name] = value
        # A flag unknown to this build (CPU) raises; the environment value is what counts then.
        with contextlib.suppress(ValueError, RuntimeError):
            paddle.set_flags({name: True if name == dispatch.FLAG_DETERMINISTIC else 1})


def default_model_factory(cfg: Config) -> paddle.nn.Layer:
    """Build the configured model (seeded by the caller)."""
    from flashcp.models import build_model

    return build_model(cfg.model)


class Trainer:
    """Trains `cfg` on this process's share of the job (see the module docstring).

    `groups` are this rank's process groups (None: a single process, trivial groups).
    `model_factory(cfg)` builds the model after seeding (tests pass small stand-ins).
    """

    def __init__(
        self,
        cfg: Config,
        groups: ParallelGroups | None = None,
        *,
        model_factory: Any = None,
        stream: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        if groups is None:
            if cfg.parallel.world_size != 1:
                raise ValueError(
                    f"parallel degrees {cfg.parallel.dp}×{cfg.parallel.pp}×{cfg.parallel.cp} "
                    "need a launched job: run with `flashcp train` or paddle.distributed.launch"
                )
            groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
        self.groups = groups
        self.rank = int(groups.rank)
        self.is_main = self.rank == 0
        self.cp_rank, self.cp_size = int(groups.cp.rank), int(groups.cp.nranks)
        self.dp_rank, self.dp_size = int(groups.dp.rank), int(groups.dp.nranks)
        self.reduce_groups = [groups.cp, groups.dp]
        self.output_dir = Path(cfg.run.output_dir)
        self.ckpt_root = self.output_dir / ckpt.CHECKPOINT_DIR
        self.device = resolve_device(cfg)
        paddle.set_device(self._device_name())
        set_determinism(cfg)
        self.data = TrainData(cfg, dp_rank=self.dp_rank, dp_size=self.dp_size)
        self.model = (model_factory or default_model_factory)(cfg)
        self.model.train()
        self.params = trainable(self.model)
        self.scheduler = build_scheduler(cfg.train)
        self.optimizer = build_optimizer(self.model, cfg.train, self.scheduler)
        self.step = 0
        self.resumed_from: Path | None = None
        self.stream = stream
        self._fixed_assignment: Assignment | None = None
        if cfg.parallel.cp_mode != "workload_balanced":
            self._fixed_assignment = make_assignment(cfg.parallel.cp_mode, self.cp_size)

    def _device_name(self) -> str:
        if self.device == "cpu":
            return "cpu"
        current = str(paddle.get_device())
        return current if current.startswith("gpu") else "gpu"

    # -- resume -----------------------------------------------------------------------------

    def _resume_source(self) -> Path | None:
        policy = self.cfg.checkpoint.resume
        if policy == "never":
            existing = [p for _, p in ckpt.list_checkpoints(self.ckpt_root)]
            if existing:
                raise RuntimeError(
                    f"run.output_dir {self.output_dir} already holds checkpoints "
                    f"({existing[-1].name}) and checkpoint.resume is never: set "
                    "checkpoint.resume=auto to continue that run, or choose another "
                    "run.output_dir"
                )
            return None
        if policy == "auto":
            return ckpt.latest_checkpoint(self.ckpt_root, warn=self.is_main)
        return Path(policy)

    def resume(self) -> Path | None:
        """Load the checkpoint `checkpoint.resume` selects, if any; returns its path."""
        source = self._resume_source()
        if source is None:
            return None
        loaded = ckpt.load_checkpoint(source)
        state = loaded.state
        if state.get("config_hash") != config_hash(self.cfg) and self.is_main:
            changed = diff_dicts(state.get("config", {}), hashed_dict(self.cfg))
            self.echo(
                f"warning: resuming from {source} with a changed config ({', '.join(changed)});"
                " the run will not match an uninterrupted one"
            )
        saved_steps = state.get("train_steps", self.cfg.train.steps)
        if saved_steps != self.cfg.train.steps:
            self.echo(
                f"note: train.steps changed from {saved_steps} to {self.cfg.train.steps} since "
                f"{source}: the cosine schedule is recomputed for the new length"
            )
        load_model_arrays(self.model, loaded.model)
        load_optimizer_arrays(self.optimizer, self.model, loaded.optimizer)
        self.scheduler.set_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.step = loaded.step
        self.resumed_from = source
        return source

    def save(self) -> Path | None:
        """Rank 0 writes a checkpoint of the current step; every rank waits for it."""
        path = None
        if self.is_main:
            state = {
                "config_hash": config_hash(self.cfg),
                "config": hashed_dict(self.cfg),
                "scheduler": self.scheduler.state_dict(),
                "data": self.data.state_dict(),
                "rng": rng_state(),
                "parallel": {"dp": self.dp_size, "cp": self.cp_size},
                "train_steps": self.cfg.train.steps,
            }
            path = ckpt.save_checkpoint(
                self.ckpt_root,
                self.step,
                model=model_arrays(self.model),
                optimizer=optimizer_arrays(self.optimizer, self.model),
                state=state,
                keep_last=self.cfg.checkpoint.keep_last,
            )
        barrier(self.groups.world, timeout=SAVE_BARRIER_TIMEOUT)
        return path

    # -- one step ---------------------------------------------------------------------------

    def assignment_for(self, batch: Batch) -> Assignment:
        """The step's CP layout: fixed per mode, or balanced from this batch's global mask."""
        if self._fixed_assignment is not None:
            return self._fixed_assignment
        return make_assignment(
            "workload_balanced", self.cp_size, batch.mask.indices, causal=batch.mask.causal
        )

    def _forward_loss(self, local: LocalBatch, denom: float) -> paddle.Tensor:
        from flashcp.models import AttentionContext

        ctx = AttentionContext(
            mask=local.mask.indices,
            causal=local.mask.causal,
            group=self.groups.cp,
            assignment=local.assignment,
            mode=self.cfg.parallel.cp_mode,
            fa4_unavailable=self.cfg.attention.fa4_unavailable,
        )
        ids = paddle.to_tensor(local.input_ids)
        pos = paddle.to_tensor(local.positions)
        labels = paddle.to_tensor(local.labels)
        bf16 = self.cfg.train.dtype == "bfloat16"
        with paddle.amp.auto_cast(enable=bf16, dtype="bfloat16", level="O1"):
            logits = self.model(ids, pos, ctx)
        vocab = int(logits.shape[-1])
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        per_token = F.cross_entropy(
            logits.reshape([-1, vocab]),
            labels.reshape([-1, 1]),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return per_token.sum() / denom

    def train_step(self) -> StepMetrics:
        """Run one optimizer step (see the module docstring); returns its metrics."""
        start = time.perf_counter()
        step = self.step + 1
        batches = self.data.next_step()
        locals_ = [shard_batch(b, self.cp_rank, self.assignment_for(b)) for b in batches]
        counts = all_reduce_values([sum(lb.num_targets for lb in locals_)], self.reduce_groups)
        targets = int(round(counts[0]))
        denom = float(max(targets, 1))
        loss_local = 0.0
        for local in locals_:
            loss = self._forward_loss(local, denom)
            loss.backward()
            loss_local += float(loss)
        params = [p for _, p in self.params]
        grads_finite = math.isfinite(squared_norm(params))
        world = int(self.groups.world.nranks)
        flags = np.zeros(1 + 2 * world)
        flags[0] = loss_local
        flags[1 + self.rank] = 0.0 if math.isfinite(loss_local) else 1.0
        flags[1 + world + self.rank] = 0.0 if grads_finite else 1.0
        reduced = all_reduce_values(flags, self.reduce_groups)
        loss_value = float(reduced[0])
        bad_loss = [r for r in range(world) if reduced[1 + r] > 0]
        bad_grad = [r for r in range(world) if reduced[1 + world + r] > 0]
        lr = float(self.scheduler.get_lr())
        skipped = False
        if bad_loss or bad_grad:
            self._nonfinite(step, loss_value, bad_loss, bad_grad)
            skipped = True
            grad_norm = float("nan")
        else:
            bucket = int(self.cfg.parallel.grad_bucket_mb * 2**20)
            sync_grads(params, self.reduce_groups, bucket_bytes=bucket)
            grad_norm = math.sqrt(squared_norm(params))
            if self.cfg.debug.dump_grads and self.is_main:
                self._dump_grads(step)
            self.optimizer.step()
        self.optimizer.clear_grad()
        self.scheduler.step()
        self.step = step
        elapsed = time.perf_counter() - start
        seq_len = self.data.seq_len
        tokens = self.dp_size * self.cfg.train.grad_accum * self.cfg.data.micro_batch_size * seq_len
        return StepMetrics(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            tokens=tokens,
            targets=targets,
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
            step_time_s=elapsed,
            peak_memory_gib=peak_memory_gib(),
            skipped=skipped,
        )

    def _nonfinite(self, step: int, loss: float, bad_loss: list[int], bad_grad: list[int]) -> None:
        parts = []
        if bad_loss:
            parts.append(f"loss on rank(s) {', '.join(map(str, bad_loss))}")
        if bad_grad:
            parts.append(f"gradients on rank(s) {', '.join(map(str, bad_grad))}")
        what = " and ".join(parts)
        if self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {what} at step {step} (loss {loss}); stopping. Lower train.lr, "
                "check the data, or set train.on_nonfinite=skip to drop such steps"
            )
        self.echo(f"warning: non-finite {what} at step {step}: update skipped")

    def _dump_grads(self, step: int) -> None:
        from safetensors.numpy import save_file

        out = self.output_dir / GRADS_DIR
        out.mkdir(parents=True, exist_ok=True)
        arrays = {n: p.grad.numpy() for n, p in self.params if p.grad is not None}
        save_file(arrays, str(out / f"step_{step}.safetensors"))

    # -- the run ----------------------------------------------------------------------------

    def echo(self, text: str) -> None:
        if self.is_main:
            print(text, file=self.stream, flush=True)

    def describe(self) -> str:
        c = self.cfg
        n = sum(int(np.prod(p.shape)) for _, p in self.params)
        data = c.data.path or "built-in corpus"
        return (
            f"flashcp {c.run.recipe}: {c.model.arch} model, {n / 1e6:.2f}M parameters | "
            f"dp={self.dp_size} pp=1 cp={self.cp_size} ({c.parallel.cp_mode}) | seq_len "
            f"{self.data.seq_len} × micro-batch {c.data.micro_batch_size} × accum "
            f"{c.train.grad_accum} | {self.device} {c.train.dtype} | data {data}: "
            f"{self.data.num_documents} docs, {self.data.num_tokens} tokens"
        )

    def fit(self) -> TrainResult:
        """Resume if configured, then train until `train.steps`; returns what ran."""
        cfg = self.cfg
        source = self.resume()
        start = self.step
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(to_yaml(cfg))
        self.echo(self.describe())
        if source is not None:
            self.echo(f"resumed from {source} at step {start}")
        writer = MetricsWriter(
            self.output_dir,
            enabled=self.is_main,
            total_steps=cfg.train.steps,
            log_every=cfg.train.log_every,
            start_step=start,
            stream=self.stream,
        )
        result = TrainResult(start_step=start, final_step=start, resumed_from=source)
        every = cfg.checkpoint.every
        end = cfg.train.steps
        if cfg.run.stop_after_steps:
            end = min(end, start + cfg.run.stop_after_steps)
        try:
            while self.step < end:
                m = self.train_step()
                writer.log(m)
                result.metrics.append(m)
                result.final_step = self.step
                if every > 0 and (self.step % every == 0 or self.step == end):
                    path = self.save()
                    if path is not None:
                        writer.echo(f"saved checkpoint {path}")
        finally:
            writer.close()
        return result
