"""`flashcp eval CONFIG|RUN_DIR [key=value ...]`: a model evaluated on `eval.path`, no training.

What is evaluated (`select_weights`):

* a run's checkpoint: the newest intact one in `<run.output_dir>/checkpoints`
  (`checkpoint.resume: auto`, the default; a RUN_DIR given to `flashcp eval` is read through
  its `config.yaml`) or the one `checkpoint.resume` names — the model as that run left it (with
  LoRA: its adapters over the weights the run started from);
* else the weights a run would start from: `model.from_pretrained` (a Hugging Face directory)
  or `checkpoint.init_from`.

With neither there is nothing to evaluate (a seeded random model is refused, `EvalError`), and
checkpoints that are all broken are refused rather than silently skipped.

The ranks are built as for training (`flashcp.parallelize.build_stage`: each rank its pipeline stage
and ep share, the config's dp × cp × pp × ep layout; one process when the world is 1) but without
optimizer, gradients or training data, and the held-out set runs through the training evaluation
itself (`evaluator.Evaluator`: one pass, or `eval.max_batches`): pretrain / SFT report the token-
weighted cross-entropy over the targets (`eval/loss`, the assistant tokens of conversations), its
perplexity and the target count; DPO the mean DPO loss, the rewards of chosen and rejected answers,
their margin and the reward accuracy, as TRL's evaluation does.

The DPO reference is what DPO trains against: the weights the run starts from (a frozen copy,
or with LoRA the policy with its adapters off; `DPORecipe.setup`, run before the checkpoint is
loaded). Evaluating a DPO run's checkpoint therefore says what DPO learned; evaluating a model
directory alone compares the model with itself — rewards and margins are 0 and the loss is
log 2 by definition, which the results note (`reference`).

Rank 0 writes `<run.output_dir>/eval_results.json` (an earlier one is renamed
`eval_results.old-<YYYYmmdd-HHMMSS>.json`, never overwritten: `keep_aside`) and prints one
summary line (`summary_line`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import paddle

from flashcp.checkpoint import format as ckpt
from flashcp.checkpoint.checkpointer import load_weights
from flashcp.checkpoint.experts import ExpertArrays
from flashcp.config import Config, config_changes, config_hash
from flashcp.distributed import ParallelGroups, startup_phase
from flashcp.evaluation.evaluator import PREFIX, build_evaluator
from flashcp.parallelize import build_runner, build_stage
from flashcp.problems import Problem
from flashcp.rank_setup import process_groups, resolve_runtime, seed_rngs, use_device
from flashcp.recipes import build_recipe
from flashcp.run_info import duration, provenance
from flashcp.rundir import ASIDE, CHECKPOINT_DIR, EVAL_RESULTS_FILE

LAYOUT_AND_TRAINING = ("parallel.", "train.", "data.path", "data.shuffle", "data.balance")
"""Config keys a checkpoint may be evaluated under other values of without a note: the layout
(any loads any), how it trained, and which training data it read."""


class EvalError(ValueError):
    """Nothing to evaluate, or no eval set: the message names the keys to set; `key` is the
    config key it is about (`eval_problems` reports it so)."""

    def __init__(self, message: str, key: str = "checkpoint.resume") -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Weights:
    """What an evaluation loads: a run's checkpoint over the weights the run starts from."""

    checkpoint: Path | None
    """The run's checkpoint (None: the starting weights alone)."""
    start: str | None
    """`model.from_pretrained` or `checkpoint.init_from` (None: a seeded init, which a LoRA
    checkpoint's adapters sit on)."""

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        return f"model {self.start}"


def select_weights(cfg: Config, *, verify: bool = True, warn: bool = True) -> Weights:
    """The weights `cfg` evaluates (module docstring); `EvalError` when there are none.
    `verify=False` takes the newest checkpoint directory unchecked (a quick look before
    launch; each rank verifies)."""
    start = cfg.model_from_pretrained or cfg.checkpoint.init_from
    policy = cfg.checkpoint.resume
    checkpoint: Path | None = None
    if policy == "auto":
        root = Path(cfg.run.output_dir) / CHECKPOINT_DIR
        found = ckpt.list_checkpoints(root)
        if found:
            checkpoint = ckpt.latest_checkpoint(root, warn=warn) if verify else found[-1][1]
            if checkpoint is None:
                raise EvalError(
                    f"no intact checkpoint in {root} (all {len(found)} are broken): name one "
                    "with checkpoint.resume=PATH, or evaluate the starting weights with "
                    "checkpoint.resume=never"
                )
    elif policy != "never":
        checkpoint = Path(policy)
        if not checkpoint.is_dir():
            raise EvalError(
                f"checkpoint.resume {policy} is not a checkpoint directory: name a run's "
                "checkpoints/step_N"
            )
    if checkpoint is None and start is None:
        raise EvalError(
            f"nothing to evaluate: {Path(cfg.run.output_dir) / CHECKPOINT_DIR} holds no "
            "checkpoint and neither model.from_pretrained nor checkpoint.init_from is set: "
            "give a run directory (flashcp eval RUN_DIR) or set run.output_dir to a run's, "
            "set model.from_pretrained=DIR, or checkpoint.init_from=PATH",
            key="model.from_pretrained",
        )
    return Weights(checkpoint, start)


NO_EVAL_SET = Problem("eval.path", "null: set eval.path to the held-out set (eval.path=FILE)")
"""The refusal of an evaluation with nothing to evaluate on."""


def eval_problems(cfg: Config) -> list[Problem]:
    """What `flashcp eval` (and each of its ranks) checks beyond the config's preflight
    (`flashcp.preflight`, `evaluating=True`) before it builds or launches anything: an eval
    set, and weights to evaluate (`select_weights`, the newest checkpoint unverified)."""
    problems = [] if cfg.eval.path is not None else [NO_EVAL_SET]
    try:
        select_weights(cfg, verify=False, warn=False)
    except EvalError as exc:
        problems.append(Problem(exc.key, str(exc)))
    return problems


def keep_aside(path: Path) -> Path | None:
    """Rename an existing `path` to `<stem>.old-<YYYYmmdd-HHMMSS>[-N]<suffix>` (never
    overwritten); returns the new name, None when there was nothing."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        tag = f"{ASIDE}{stamp}" + (f"-{n}" if n else "")
        target = path.with_name(f"{path.stem}{tag}{path.suffix}")
        if not target.exists():
            os.replace(path, target)
            return target
    raise FileExistsError(f"no free name to keep {path} aside")


def summary_line(recipe: str, metrics: dict[str, float], weights: Weights, results: Path,
                 seconds: float) -> str:  # fmt: skip
    """The one line `flashcp eval` ends with."""
    m = {k.removeprefix(PREFIX): v for k, v in metrics.items()}
    parts = [f"flashcp eval {recipe}: loss {m['loss']:.4f}"]
    if "examples" in m:  # DPO
        for key in ("rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected"):
            parts.append(f"{key} {m[key]:.4f}")
        parts.append(f"{int(m['examples']):,} pairs in {int(m['rows'])} rows")
    else:
        parts.append(f"perplexity {m['perplexity']:.4g}")
        parts.append(f"{int(m['targets']):,} targets in {int(m['rows'])} rows")
    parts += [weights.describe(), f"results {results}", duration(seconds)]
    return " | ".join(parts)


class Evaluation:
    """One rank's part of `flashcp eval` (collective: every rank builds one and calls `run`).

    `groups` are this rank's process groups (None: one process); `model_factory(cfg, stage)`
    builds the stage as for `flashcp.trainer.Trainer` (tests pass their own); `stream` takes
    rank 0's lines."""

    @startup_phase()  # ranks build and load at their own pace
    def __init__(
        self,
        cfg: Config,
        groups: ParallelGroups | None = None,
        *,
        model_factory: Any = None,
        stream: TextIO | None = None,
    ) -> None:
        self.started = time.time()
        self.cfg, self.stream = cfg, stream
        if cfg.eval.path is None:
            raise EvalError(NO_EVAL_SET.message, key=NO_EVAL_SET.key)
        self.groups = groups = process_groups(cfg, groups)
        self.main = int(groups.rank) == 0
        device, dtype = resolve_runtime(cfg)
        use_device(device)
        seed_rngs(cfg)
        self.weights = select_weights(cfg, warn=self.main)
        self.recipe = build_recipe(cfg, groups)
        self.model, _, lora = build_stage(cfg, groups, model_factory)
        self.recipe.setup(self.model)  # the DPO reference: the starting weights
        self.step: int | None = None
        """The checkpoint's step (None: the starting weights)."""
        if self.weights.checkpoint is not None:
            self.step = self._load(self.weights.checkpoint, lora is not None)
        self.model.eval()
        self.runner = build_runner(cfg, groups, self.model, dtype)
        self.evaluator = build_evaluator(cfg, groups, self.recipe, cfg.eval.path)

    def echo(self, text: str) -> None:
        """Print `text` on rank 0."""
        if self.main:
            print(text, file=self.stream, flush=True)

    def _load(self, path: Path, lora: bool) -> int:
        """The checkpoint's weights into this rank's stage (no optimizer state); a config that
        differs from the one that saved it in what the model computes is named (a LoRA rank
        that differs fails here)."""
        loaded = ckpt.load_checkpoint(path, optimizer=False)
        state = loaded.state
        if self.main and state.get("config_hash") != config_hash(self.cfg):
            changed = [k for k in config_changes(state.get("config", {}), self.cfg)
                       if not k.startswith(LAYOUT_AND_TRAINING)]  # fmt: skip
            if changed:
                self.echo(f"note: evaluating {path} under a changed config ({', '.join(changed)})")
        load_weights(self.model, loaded, stages=int(self.groups.pp.nranks), lora=lora,
                     experts=ExpertArrays(self.model, self.groups))  # fmt: skip
        return int(loaded.step)

    def reference_note(self) -> str | None:
        """For DPO: what the rewards are measured against (module docstring)."""
        if self.cfg.run.recipe != "dpo":
            return None
        base = "the policy with its LoRA adapters off" if "lora" in self.cfg.extras else (
            f"the starting weights ({self.weights.start or 'the seeded init'})")  # fmt: skip
        if self.weights.checkpoint is None:
            return (
                f"the reference is the model itself ({base}): rewards and margins are 0 and the "
                "loss is log 2 by definition; evaluate a DPO run's checkpoint to measure what "
                "it learned"
            )
        return f"the reference is {base}, what DPO trained against"

    def run(self) -> dict[str, float]:
        """Evaluate (collective); rank 0 writes the results file and the summary line.
        Returns the `eval/...` metrics (the same on every rank)."""
        self.echo(
            f"flashcp eval {self.cfg.run.recipe}: {self.weights.describe()}"
            + (f" (step {self.step})" if self.step is not None else "")
            + f" on {self.cfg.eval.path}: {self.evaluator.rows} rows in "
            f"{self.evaluator.batches} batches | dp={int(self.groups.dp.nranks)} "
            f"pp={int(self.groups.pp.nranks)} cp={int(self.groups.cp.nranks)}"
            + (f" ep={int(self.groups.ep.nranks)}" if int(self.groups.ep.nranks) > 1 else "")
        )
        metrics = self.evaluator.run(self.runner)
        if self.main:
            path = self._write(metrics)
            note = self.reference_note()
            if note is not None and self.weights.checkpoint is None:
                self.echo(f"note: {note}")
            self.echo(summary_line(self.cfg.run.recipe, metrics, self.weights, path,
                                   time.time() - self.started))  # fmt: skip
        return metrics

    def _write(self, metrics: dict[str, float]) -> Path:
        out = Path(self.cfg.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / EVAL_RESULTS_FILE
        if (moved := keep_aside(path)) is not None:
            self.echo(f"kept the earlier {EVAL_RESULTS_FILE} as {moved}")
        g = self.groups
        document = {
            "recipe": self.cfg.run.recipe,
            "eval_path": self.cfg.eval.path,
            "metrics": metrics,
            "weights": {
                "checkpoint": None if self.weights.checkpoint is None
                else str(self.weights.checkpoint.resolve()),
                "step": self.step,
                "start": self.weights.start,
            },  # fmt: skip
            "reference": self.reference_note(),
            "degrees": {"dp": int(g.dp.nranks), "pp": int(g.pp.nranks), "cp": int(g.cp.nranks),
                        "ep": int(g.ep.nranks)},  # fmt: skip
            "provenance": provenance(self.started),
            "wall_time_s": round(time.time() - self.started, 3),
            "device": str(paddle.get_device()),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(tmp, path)
        return path
