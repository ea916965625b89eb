"""Training: the loop, AdamW + schedule, gradient sync over cp/dp, metrics and checkpoints.

    trainer = Trainer(cfg, groups)      # groups from flashcp.distributed.build_groups
    result = trainer.fit()              # resumes per checkpoint.resume, trains to train.steps
"""

from flashcp.trainer.checkpoint import (
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from flashcp.trainer.loop import (
    NonFiniteError,
    Trainer,
    TrainResult,
    resolve_device,
    resolve_dtype,
)
from flashcp.trainer.metrics import METRICS_FILE, MetricsWriter, StepMetrics, read_metrics
from flashcp.trainer.optim import build_optimizer, build_scheduler, lr_at, lr_factor

__all__ = [
    "METRICS_FILE",
    "Checkpoint",
    "CheckpointError",
    "MetricsWriter",
    "NonFiniteError",
    "StepMetrics",
    "TrainResult",
    "Trainer",
    "build_optimizer",
    "build_scheduler",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "lr_at",
    "lr_factor",
    "prune_checkpoints",
    "read_metrics",
    "resolve_device",
    "resolve_dtype",
    "save_checkpoint",
    "verify_checkpoint",
]
