"""What one process of a job runs on: its process groups, device, compute dtype and autocast,
and its RNG seeds.

The device and dtype rule is the one the memory planner shares (`flashcp.config.device_rule`); here
Paddle is asked whether it sees a GPU. The deterministic runtime flags are the process's too,
but its entry sets them before anything is built (`flashcp.launch.worker.set_runtime_flags`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import numpy as np
import paddle

from flashcp.config import Config
from flashcp.config.device_rule import compute_dtype, resolve_device
from flashcp.distributed import ParallelDims, ParallelGroups, build_groups
from flashcp.host_alloc import retain_freed_memory


def process_groups(cfg: Config, groups: ParallelGroups | None = None) -> ParallelGroups:
    """`groups` checked against the config's ep degree; None: a single process's trivial
    groups (refused for a multi-rank config)."""
    p = cfg.parallel
    if groups is None:
        if p.world_size != 1:
            raise ValueError(
                f"parallel degrees {p.dp}×{p.pp}×{p.cp} need a launched job: run with "
                "`flashcp train` or paddle.distributed.launch"
            )
        groups = build_groups(ParallelDims(dp=1, pp=1, cp=1, world_size=1))
    if int(groups.ep.nranks) != p.ep:
        raise ValueError(
            f"parallel.ep={p.ep} but the process groups were built with ep={groups.ep.nranks}: "
            "build them from the same config (ParallelDims(..., ep=...))"
        )
    return groups


def step_groups(groups: ParallelGroups) -> list[Any]:
    """A step's (and an evaluation's) statistics are summed over these: cp, dp, pp."""
    return [groups.cp, groups.dp, groups.pp]


def gpu_visible() -> bool:
    """Whether Paddle sees a GPU on this machine (a CUDA build with a device)."""
    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def resolve_runtime(cfg: Config) -> tuple[str, str]:
    """(device, compute dtype) of this process: `run.device` (auto: GPU when Paddle sees one)
    and `train.dtype` resolved."""
    device = resolve_device(cfg, gpu_visible())
    return device, compute_dtype(cfg, device)


def use_device(device: str) -> None:
    """Compute on `device` from now on (a GPU: the one Paddle already selected, if any); on CPU
    the process keeps freed host memory for reuse (`flashcp.host_alloc`)."""
    if device == "cpu":
        retain_freed_memory()
    current = str(paddle.get_device())
    paddle.set_device("cpu" if device == "cpu" else current if current.startswith("gpu") else "gpu")


def forward_context(dtype: str) -> Callable[[], AbstractContextManager[Any]]:
    """The forward pass's autocast context: bfloat16 O1 when the compute dtype is bf16."""
    return partial(paddle.amp.auto_cast, enable=dtype == "bfloat16", dtype="bfloat16", level="O1")


def seed_rngs(cfg: Config) -> None:
    """Seed Python, numpy and Paddle from `train.seed`."""
    seed = cfg.train.seed
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)
