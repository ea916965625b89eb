"""Pipeline parallelism: split a model into stages and run them under a 1F1B schedule.

    stage = build_stage(args, groups.pp.rank, groups.pp.nranks, seed=0)  # this stage only
    result = train_step_1f1b(stage, micro_batches, sum_cross_entropy, groups, num_targets=n)

`flashcp.parallel.schedule`: the order of passes and transfers (pure, unit-tested);
`flashcp.parallel.pipeline`: running it (and why the schedule is flashcp's own, not fleet's);
`flashcp.parallel.stage`: the layer split and building one stage alone.
"""

from flashcp.parallel.pipeline import (
    MicroBatch,
    PipelineSchedule,
    PipelineStepResult,
    StepState,
    count_targets,
    sum_cross_entropy,
    sync_tied_gradients,
    train_step_1f1b,
)
from flashcp.parallel.schedule import (
    SCHEDULES,
    Op,
    build_plans,
    comm_plan,
    max_in_flight,
    schedule_1f1b,
    schedule_gpipe,
    simulate_plans,
)
from flashcp.parallel.stage import PipelineStage, build_stage, split_layers, stage_spec

__all__ = [
    "SCHEDULES",
    "MicroBatch",
    "Op",
    "PipelineSchedule",
    "PipelineStage",
    "PipelineStepResult",
    "StepState",
    "build_plans",
    "build_stage",
    "comm_plan",
    "count_targets",
    "max_in_flight",
    "schedule_1f1b",
    "schedule_gpipe",
    "simulate_plans",
    "split_layers",
    "stage_spec",
    "sum_cross_entropy",
    "sync_tied_gradients",
    "train_step_1f1b",
]
