"""The run directory (`run.output_dir`): the name of every entry a run writes there, who writes
it, when, and what it holds. Every module asks here for these names; none spells them itself
(`tests/unit/repo/test_rundir_names.py`). Whether a run may start in a directory, and moving an
earlier run aside, is `flashcp.runstart`; the one job that may write it, `flashcp.runlock`.

Nothing here imports the rest of flashcp: every layer may ask it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOCK_FILE = ".flashcp.lock"
"""`flashcp.runlock`, taken by `flashcp train` / `flashcp eval` (or the first rank of a job
started by `paddle.distributed.launch`) before anything else is written, held for the job's
life: the holding job (what, host, PID, command). Not part of a run (`runstart.earlier_run`)."""

LOG_DIR = "logs"
"""`flashcp.launch.job`, before the ranks start: `paddle.distributed.launch`'s log directory
(`LAUNCHER_LOG`, `worker_log`, `EVAL_LOG_DIR`, `SYNC_DIR`). Not part of a run on its own."""

LAUNCHER_LOG = "launcher.log"
"""In `LOG_DIR`: `flashcp.launch.job` / `launch.supervise`, for each launch: the output of
`paddle.distributed.launch` itself (appended to after a restart)."""

WORKER_LOG = "workerlog.{rank}"
"""In `LOG_DIR`: `paddle.distributed.launch`, one per local rank: everything the rank printed
(`worker_log`); flashcp reads them to say why a rank failed (`flashcp.launch.outcome`)."""

EVAL_LOG_DIR = "eval"
"""In `LOG_DIR`: the launcher's log directory of a `flashcp eval` job (`flashcp.launch.preflight`),
so an evaluation never mixes its logs into the training run's."""

SYNC_DIR = "restarts"
"""In `LOG_DIR`: `flashcp.launch.nodesync`, at a failure of a multi-node job: each node's report
and node 0's decision for each attempt (`attempt<N>.<who>.json`)."""

CONFIG_FILE = "config.yaml"
"""`flashcp.trainer`, rank 0, at the start of a run: the resolved config it trains (read back by
`flashcp export` and by `flashcp eval RUN_DIR`)."""

METRICS_FILE = "metrics.jsonl"
"""`flashcp.metrics.writer`, rank 0, one JSON line per logged step (and evaluation): the run's
metrics (`flashcp plot` draws them)."""

RUN_INFO_FILE = "run_info.json"
"""`flashcp.run_info`, rank 0, at the start of a run (again at its end): provenance, the layout,
the plan, the start-up times."""

GOODPUT_FILE = "goodput.json"
"""`flashcp.metrics.goodput`, rank 0, at the start, each step, each checkpoint and the end: the
run's productive and lost time over all its attempts."""

RESTARTS_FILE = "restarts.jsonl"
"""`flashcp.launch.restart`, the launcher, one JSON line per automatic restart: cause, rank,
node, exit code, the step it resumed from (`restart_records`)."""

CHECKPOINT_DIR = "checkpoints"
"""`flashcp.checkpoint.checkpointer`, when `checkpoint.every` falls due and at the end: one
`step_<N>/` per checkpoint (layout: `flashcp.checkpoint.format`)."""

ADAPTER_DIR = "adapters"
"""`flashcp.checkpoint.checkpointer`, at the end of a LoRA run: the final adapters
(PaddleFormers' format, `flashcp.checkpoint.adapters`)."""

MERGED_DIR = "merged"
"""`flashcp.checkpoint.checkpointer`, at the end of a LoRA run with `lora.merge_at_end`: the
base weights with the adapters merged in, a Hugging Face model directory."""

GRADS_DIR = "grads"
"""`flashcp.checkpoint.checkpointer`, rank 0, every step with `debug.dump_grads`: the summed
gradients as `step_<N>.safetensors`."""

VISUALDL_DIR = "visualdl"
"""`flashcp.metrics.tracking` with `run.tracking: visualdl`: VisualDL's log."""

TENSORBOARD_DIR = "tensorboard"
"""`flashcp.metrics.tracking` with `run.tracking: tensorboard`: TensorBoard event files."""

WANDB_DIR = "wandb"
"""`wandb` itself with `run.tracking: wandb` (`flashcp.metrics.tracking` passes it the run
directory): its local copy of the run."""

EVAL_RESULTS_FILE = "eval_results.json"
"""`flashcp.evaluation.command`, rank 0, at the end of `flashcp eval`: the metrics, what was
evaluated, the layout, provenance (an earlier one is kept as `eval_results.old-<stamp>.json`)."""

PLOT_FILE = "metrics.png"
"""`flashcp plot RUN_DIR` (`flashcp.metrics.plot`) unless told where: the metrics drawn."""

ASIDE = ".old-"
"""`<output_dir><ASIDE><YYYYmmdd-HHMMSS>`, beside the run directory: where `run.overwrite` moves
an earlier run (`flashcp.runstart.move_aside`); `<stem><ASIDE><stamp><suffix>`, inside it: an
earlier `EVAL_RESULTS_FILE` kept aside."""

ENTRIES: tuple[str, ...] = (
    LOCK_FILE, LOG_DIR, CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE, GOODPUT_FILE, RESTARTS_FILE,
    CHECKPOINT_DIR, ADAPTER_DIR, MERGED_DIR, GRADS_DIR, VISUALDL_DIR, TENSORBOARD_DIR, WANDB_DIR,
    EVAL_RESULTS_FILE, PLOT_FILE,
)  # fmt: skip
"""Every name a run (its launcher, its ranks, `flashcp eval`, `flashcp plot`) writes at the top
of the run directory."""

LOG_ENTRIES: tuple[str, ...] = (LAUNCHER_LOG, WORKER_LOG, EVAL_LOG_DIR, SYNC_DIR)
"""Every name written inside `LOG_DIR`."""


def worker_log(log_dir: str | Path, rank: int) -> Path:
    """Local rank `rank`'s log in the launcher's log directory `log_dir`."""
    return Path(log_dir) / WORKER_LOG.format(rank=rank)


def restart_records(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of the run's `RESTARTS_FILE`, oldest first (empty when there is none). The
    one reader of that file: a line that is not a JSON object (torn by a crash while it was
    written) is skipped, so counting restarts never fails a run."""
    try:
        text = (Path(output_dir) / RESTARTS_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
