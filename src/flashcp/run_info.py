"""`run_info.json`: what each rank of a run built, written by rank 0 at the start of `fit`.

    {"world": 4, "degrees": {"dp": 1, "pp": 2, "cp": 2, "ep": 1}, "device": "cpu",
     "param_dtype": "float32", "compute_dtype": "float32",
     "global_batch": {"sequences": 4, "seq_len": 256, "tokens": 1024,
                      "micro_batch_size": 1, "grad_accum": 4, "dp": 1},
     "ranks": [{"rank": 0, "stage": 0, "layers": [0, 1], "params_local": ...,
                "param_bytes_local": ..., "trainable_params_local": ...,
                "reference_params_local": 0, "reference_param_bytes_local": 0,
                "allocated_bytes": ..., "peak_bytes": ...}, ...],
     "plan": {"ranks": [{"rank": 0, "stage": 0, "total_bytes": ..., "items": {...}}, ...],
              "budget_bytes": null, "fits": true, "device": "cpu", "peak_rank": 0,
              "peak_bytes": ..., "moments": {"0": "backward: layer", ...}, ...},
     "data": {"source": ..., "rows": ..., "bad_records": {...}},
     "provenance": {"flashcp": "0.1.0", "paddle": "3.3.1", "python": "3.11.7",
                    "git": {"commit": "bd5d1fe...", "dirty": false},
                    "command": "flashcp train configs/gpt/tiny_cp2.yaml train.steps=20",
                    "host": ..., "started": "2026-12-02T06:34:17Z"},
     "end": {"ended": "2026-12-02T06:35:02Z", "wall_time_s": 45.1, "status": "completed",
             "first_step": 1, "final_step": 20, "final_loss": 2.31, "eval": {...}}}

`global_batch` is what one optimizer step consumes, the whole job (`global_batch`:
micro_batch_size × grad_accum × dp sequences of seq_len tokens). `params_local` /
`param_bytes_local` count the parameters this rank materialised for the
trained module (its pipeline stage — under parallel.ep with its share of the routed experts —
LoRA adapters included); a frozen DPO reference copy is
counted apart (`reference_*`). `allocated_bytes` is the allocator's count of live Paddle tensors
after the build and `peak_bytes` its peak so far (`flashcp.metrics.memory`): a rank that built
more than its stage, even briefly, shows it there. `plan` is the memory planner's prediction for the
config on the run's device (`plan_summary`, `flashcp.plan`): per rank the planned bytes at its
peak, item by item, against `hardware.memory_gib`. `data` is what the recipe's data
read (`data_report`): rows, usable documents, tokens, and the bad records it skipped.
`provenance` is what made the run: the flashcp, Paddle and Python versions, the git commit
(and whether the tree had uncommitted changes) when flashcp runs from a checkout, the command
line (`flashcp train ...` as typed, passed to the ranks in `FLASHCP_COMMAND`; a rank started
by the launcher directly records its own argv) and the start time (UTC). `end` is written when
the run ends (`finish_run_info`): end time, wall time since the trainer was built, how it ended,
the steps it ran, the final loss and the last evaluation.

The same facts make the trainer's start line (`banner`), its last line (`summary`) and the
`mfu` metric (`RunFacts`). What this module reads of a run comes typed — `RunStart` (filled by
the trainer after `resume`) and `RunEnd.of`'s arguments — never the trainer itself, so its
imports show what it depends on. The pre-emption grace arithmetic is `flashcp.preemption`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from flashcp.checkpoint.format import list_checkpoints
from flashcp.config import Config
from flashcp.data.epochs import format_passes, passes
from flashcp.data.packing import document_masking
from flashcp.distributed import ParallelGroups, all_gather_object
from flashcp.log import readable_count
from flashcp.metrics import flops, memory, tracking
from flashcp.optim.grads import trainable
from flashcp.optim.lr import describe as lr_schedule
from flashcp.optim.master_optimizer import MasterOptimizer
from flashcp.optim.param_optimizer import ParamOptimizer
from flashcp.plan import plan
from flashcp.recipes.base import StepSource
from flashcp.rundir import CHECKPOINT_DIR, RUN_INFO_FILE

COMMAND_ENV = "FLASHCP_COMMAND"
"""The command line `flashcp train` was given, handed to every rank it launches."""
GIT_TIMEOUT_S = 10.0
"""How long the git commit lookup may take (a slow network file system: left out)."""


def global_batch(cfg: Config, dp: int, seq_len: int) -> dict[str, int]:
    """What one optimizer step consumes, the whole job: `sequences` = micro_batch_size ×
    grad_accum × dp (packed rows for DPO) of `seq_len` tokens, `tokens` their product
    (padding included); with the three factors."""
    sequences = cfg.data.micro_batch_size * cfg.train.grad_accum * dp
    return {
        "sequences": sequences,
        "seq_len": int(seq_len),
        "tokens": sequences * int(seq_len),
        "micro_batch_size": cfg.data.micro_batch_size,
        "grad_accum": cfg.train.grad_accum,
        "dp": dp,
    }


@dataclass(frozen=True)
class RunFacts:
    """What this rank's run is, fixed when the trainer is built: for the start line,
    `run_info.json` and the `mfu` metric."""

    device: str
    dtype: str
    """The compute dtype (`train.dtype` resolved, `flashcp.config.device_rule`)."""
    layers: range
    """This rank's decoder layers (its pipeline stage's)."""
    global_batch: dict[str, int]
    flops_per_token: float
    """Model FLOPs of one trained token (`flashcp.metrics.flops`)."""
    peak_tflops: float | None
    devices: int

    @classmethod
    def of(
        cls, cfg: Config, groups: ParallelGroups, *, device: str, dtype: str, layers: range,
        seq_len: int,
    ) -> RunFacts:  # fmt: skip
        fpt = flops.flops_per_token(
            cfg.model,
            seq_len,
            lora=cfg.extras.get("lora") is not None,
            reference=cfg.run.recipe == "dpo",
        )
        batch = global_batch(cfg, int(groups.dp.nranks), seq_len)
        world = int(groups.world.nranks)
        return cls(device, dtype, layers, batch, fpt, cfg.hardware.peak_tflops, world)

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation of a step (None without `hardware.peak_tflops`)."""
        if self.peak_tflops is None:
            return None
        return flops.mfu(self.flops_per_token, tokens_per_s, self.peak_tflops, self.devices)


@dataclass(frozen=True)
class RunStart:
    """What the start line and `run_info.json` tell of this rank's built run: the trainer
    fills it after `resume` (so `last_step` counts from the step it resumed)."""

    cfg: Config
    groups: ParallelGroups
    facts: RunFacts
    model: paddle.nn.Layer
    """This rank's trained module (its stage; LoRA adapters included)."""
    reference: paddle.nn.Layer | None
    """A recipe's frozen copy (DPO's reference model), counted apart; None without one."""
    data: StepSource
    optimizer: ParamOptimizer | MasterOptimizer
    checkpoints: str
    """Where checkpoints are written (`Checkpointer.root`)."""
    last_step: int
    """The step this run stops after (`train.steps` or `run.stop_after_steps`)."""
    evaluation: tuple[int, int] | None
    """(rows, batches) of each held-out evaluation; None without `eval.path`."""
    started: float
    """When the run began (its build included), seconds since the epoch."""


def trainable_count(model: paddle.nn.Layer) -> int:
    """Elements of `model`'s trainable parameters."""
    return sum(int(np.prod(p.shape)) for _, p in trainable(model))


def banner(run: RunStart) -> str:
    """The trainer's start line: recipe, model, parameters, layout, global batch, device,
    data, optimizer, steps and epochs, LR schedule, reporting, mfu basis and evaluation."""
    c, g, f = run.cfg, run.groups, run.facts
    n = trainable_count(run.model)
    lora = c.extras.get("lora") is not None
    what = "trainable parameters (LoRA adapters)" if lora else "parameters"
    pp, ep = int(g.pp.nranks), int(g.ep.nranks)
    stage = ""
    if pp > 1:
        stage = f", stage 0 layers [{f.layers.start}, {f.layers.stop}) {c.parallel.pp_schedule}"
    b = f.global_batch
    masters = isinstance(run.optimizer, MasterOptimizer)
    peak = c.hardware.peak_tflops
    parts = [
        run_length(c, b["sequences"], getattr(run.data, "rows_per_epoch", None)),
        lr_schedule(c.train),
        f"reporting to {tracking.describe(c.run.report_to)}",
        f"mfu vs {peak:g} TFLOP/s per device ({f.flops_per_token / 1e9:.3g} GFLOP/token)"
        if peak is not None
        else "mfu not reported (set hardware.peak_tflops)",
    ]
    parts.append(c.checkpoint.describe(run.last_step, run.checkpoints))
    parts += c.notes  # what the loader decided for the user (`Config.notes`)
    if run.evaluation is not None:
        rows, batches = run.evaluation
        when = f"every {c.eval.every} steps and " if c.eval.every else ""
        parts.append(
            f"eval {c.eval.path}: {rows} rows in {batches} batches {when}after step "
            f"{c.train.steps}"
        )
    mask = ""
    if c.attention.mask != "causal":
        mask = f" | attention mask {document_masking(c).describe()} per document"
        if c.attention.prefix_len:
            mask += f" (prefix {c.attention.prefix_len} tokens)"
    return (
        f"flashcp {c.run.recipe}: {c.model.arch} model, {readable_count(n)} {what} on rank 0 | "
        f"dp={int(g.dp.nranks)} pp={pp} cp={int(g.cp.nranks)}"
        + (f" ep={ep}" if ep > 1 else "")
        + f" ({c.parallel.cp_mode}"
        f"{stage}){mask} | global batch {b['sequences']} seq × {b['seq_len']} = "
        f"{b['tokens']:,} tokens/step (micro-batch {b['micro_batch_size']} × accum "
        f"{b['grad_accum']} × dp {b['dp']}) | {f.device} {f.dtype} | "
        f"{run.data.describe()}"
        + (f" | {run.optimizer.describe()}" if masters else "")
        + f" | {' | '.join(parts)}"
    )


def run_length(cfg: Config, rows_per_step: int, rows_per_epoch: float | None) -> str:
    """How long the run is: its steps and the passes over the data they make ("60 steps ≈ 2.3
    epochs"; with `train.epochs`, the steps they gave)."""
    steps = f"{cfg.train.steps} steps"
    if rows_per_epoch is None or rows_per_epoch <= 0:
        return steps
    made = format_passes(passes(cfg.train.steps, rows_per_step, rows_per_epoch))
    if cfg.train.epochs is not None:
        noun = "pass" if made == "1" else "passes"
        return f"{steps} for train.epochs {cfg.train.epochs:g} ({made} {noun} over the data)"
    return f"{steps} ≈ {made} epochs of the data"


def parameter_totals(module: paddle.nn.Layer | None) -> tuple[int, int]:
    """(number of parameter elements, their bytes) of `module` (0, 0 for None)."""
    if module is None:
        return 0, 0
    count = nbytes = 0
    for p in module.parameters():
        n = int(np.prod(p.shape)) if len(p.shape) else 1
        count += n
        nbytes += n * int(p.element_size())
    return count, nbytes


def rank_record(run: RunStart) -> dict[str, Any]:
    """This rank's entry of `run_info.json`."""
    params, nbytes = parameter_totals(run.model)
    ref_params, ref_bytes = parameter_totals(run.reference)
    r = run.facts.layers
    return {
        "rank": int(run.groups.rank),
        "stage": int(run.groups.pp.rank),
        "layers": [r.start, r.stop],
        "params_local": params,
        "param_bytes_local": nbytes,
        "trainable_params_local": trainable_count(run.model),
        "reference_params_local": ref_params,
        "reference_param_bytes_local": ref_bytes,
        "allocated_bytes": memory.allocated_bytes(),
        "peak_bytes": memory.peak_bytes(),
    }


def plan_summary(cfg: Config, device: str | None = None) -> dict[str, Any]:
    """The memory plan of `cfg` on `device` (`flashcp.plan`, what `flashcp plan --json`
    prints: every rank's planned bytes item by item, the budget and whether it fits), plus the
    device and dtypes it assumed, each stage's peak moment, and the largest rank — to compare
    with the measured `peak_bytes` of the rank records and metrics.jsonl."""
    p = plan(cfg, device=device)
    peak = p.peak
    return {
        **p.to_json(),
        "device": p.device,
        "compute_dtype": p.compute_dtype,
        "param_dtype": p.param_dtype,
        "moments": {str(r.stage): r.moment for r in p.stages()},
        "peak_rank": peak.rank,
        "peak_bytes": peak.total_bytes,
        "notes": list(p.notes),
    }


def run_info(run: RunStart, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The `run_info.json` document from every rank's `rank_record`."""
    cfg, g, f = run.cfg, run.groups, run.facts
    return {
        "world": int(g.world.nranks),
        "degrees": {
            "dp": int(g.dp.nranks),
            "pp": int(g.pp.nranks),
            "cp": int(g.cp.nranks),
            "ep": int(g.ep.nranks),
        },
        "device": f.device,
        "param_dtype": cfg.train.param_dtype,
        "compute_dtype": f.dtype,
        "global_batch": f.global_batch,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "plan": plan_summary(cfg, f.device),
        "data": data_report(run.data),
        "provenance": provenance(run.started),
    }


def data_report(data: StepSource) -> dict[str, Any] | None:
    """The recipe data's `data_report()`: source, rows, usable documents/pairs, tokens and the
    bad records skipped (by reason, with their first rows); None if the data has none."""
    report = getattr(data, "data_report", None)
    return report() if callable(report) else None


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this run: `FLASHCP_COMMAND` (set by `flashcp train`), else
    this process's own argv (`python -m paddle.distributed.launch` started it directly)."""
    given = os.environ.get(COMMAND_ENV)
    if given:
        return given
    args = list(sys.argv if argv is None else argv)
    if args:
        args[0] = Path(args[0]).name
    return shlex.join(args)


def source_revision(where: str | Path | None = None) -> dict[str, Any] | None:
    """`{"commit", "dirty"}` of the git checkout flashcp's own source lies in (an editable
    install from a clone), or None: an installed wheel, no git, or no answer in time."""
    here = Path(where) if where is not None else Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(here), *args], capture_output=True,
                                  text=True, timeout=GIT_TIMEOUT_S, check=False)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def utc(seconds: float) -> str:
    """`seconds` since the epoch as an ISO 8601 UTC time to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def provenance(started: float) -> dict[str, Any]:
    """What made this run (module docstring): versions, git commit, command, host, start."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        flashcp_version = version("flashcp")
    except PackageNotFoundError:  # a source tree that was never installed
        flashcp_version = "unknown"
    return {
        "flashcp": flashcp_version,
        "paddle": str(paddle.__version__),
        "python": platform.python_version(),
        "git": source_revision(),
        "command": command_line(),
        "host": socket.gethostname(),
        "started": utc(started),
    }


def duration(seconds: float) -> str:
    """`seconds` for a person: 12.3 s, 4m 05s, 2h 03m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


@dataclass(frozen=True)
class RunEnd:
    """How a `fit` ended, for `run_info.json`'s `end` and the last line (`summary`)."""

    status: str
    """`completed` (train.steps reached), `stopped` (run.stop_after_steps), `pre-empted` or
    `failed: ...`."""
    started: float
    ended: float
    first_step: int
    """The first step this run trained (1, or one past the checkpoint it resumed)."""
    final_step: int
    total_steps: int
    first_loss: float | None
    final_loss: float | None
    eval: dict[str, float]
    """The last evaluation's `eval/...` metrics (empty without one)."""
    checkpoint: str | None
    """The newest checkpoint in the run directory when it ended."""

    @classmethod
    def of(
        cls, cfg: Config, *, started: float, first_step: int, final_step: int,
        losses: Sequence[float], evaluated: Mapping[str, float], failure: BaseException | None,
        preempted: bool,
    ) -> RunEnd:  # fmt: skip
        """How the run of `cfg` ended, now: `failed: <exception>` (`failure`), `pre-empted`,
        `completed` (train.steps reached) or `stopped`; the steps it trained from `first_step`
        to `final_step`, their first and last `losses`, the last evaluation, and the newest
        checkpoint in its run directory."""
        if failure is not None:
            status = f"failed: {type(failure).__name__}"
        elif preempted:
            status = "pre-empted"
        else:
            status = "completed" if final_step >= cfg.train.steps else "stopped"
        saved = list_checkpoints(Path(cfg.run.output_dir) / CHECKPOINT_DIR)
        return cls(
            status=status, started=started, ended=time.time(), first_step=first_step,
            final_step=final_step, total_steps=cfg.train.steps,
            first_loss=losses[0] if losses else None, final_loss=losses[-1] if losses else None,
            eval=dict(evaluated), checkpoint=str(saved[-1][1]) if saved else None,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "ended": utc(self.ended),
            "wall_time_s": round(self.ended - self.started, 3),
            "status": self.status,
            "first_step": self.first_step,
            "final_step": self.final_step,
            "total_steps": self.total_steps,
            "final_loss": self.final_loss,
            "eval": dict(self.eval),
            "checkpoint": self.checkpoint,
        }


def summary(recipe: str, output_dir: str | Path, end: RunEnd) -> str:
    """The run's last line: how it ended, steps, time, loss, eval, newest checkpoint, where."""
    ran = end.final_step - end.first_step + 1
    steps = f"step {end.final_step} of {end.total_steps}"
    if ran > 0 and end.first_step > 1:
        steps += f" ({ran} this run, resumed at {end.first_step - 1})"
    parts = [f"flashcp {recipe}: {end.status} at {steps} in {duration(end.ended - end.started)}"]
    if end.final_loss is not None:
        first = f"{end.first_loss:.4f} -> " if end.first_loss is not None and ran > 1 else ""
        parts.append(f"loss {first}{end.final_loss:.4f}")
    for key in ("eval/loss", "eval/rewards/accuracy"):
        if key in end.eval:
            parts.append(f"{key} {end.eval[key]:.4f}")
    if end.checkpoint is not None:
        parts.append(f"checkpoint {end.checkpoint}")
    parts.append(f"run {output_dir}")
    return " | ".join(parts)


def finish_run(cfg: Config, end: RunEnd) -> str | None:
    """Rank 0, when a `fit` ends: add `end` to the run's `run_info.json`; returns the run's
    last line (`summary`), or None when it failed (its error is the last word)."""
    finish_run_info(cfg.run.output_dir, end)
    if end.status.startswith("failed"):
        return None
    return summary(cfg.run.recipe, cfg.run.output_dir, end)


def finish_run_info(output_dir: str | Path, end: RunEnd) -> Path | None:
    """Add `end` to `<output_dir>/run_info.json` (rank 0, after `write_run_info`); None when
    there is no such file (nothing to add to)."""
    path = Path(output_dir) / RUN_INFO_FILE
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    info["end"] = end.to_json()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def write_run_info(run: RunStart) -> Path | None:
    """Gather every rank's record (collective over the world) and write `run_info.json` on
    rank 0; returns its path there (None elsewhere)."""
    ranks = all_gather_object(rank_record(run), run.groups.world)
    if int(run.groups.rank) != 0:
        return None
    path = Path(run.cfg.run.output_dir) / RUN_INFO_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(run_info(run, ranks), indent=2) + "\n")
    os.replace(tmp, path)
    return path
