"""`run.device` and `train.dtype` resolved: ONE rule, for the trainer and the memory planner.

The trainer knows whether Paddle sees a GPU here (`gpu_visible`, probed by
`flashcp.rank_setup.resolve_runtime`) and refuses what no kernel runs; the planner (`flashcp.plan`)
plans for a machine it cannot see: there `run.device: auto` counts as cpu and nothing is
refused (a what-if).
"""

from __future__ import annotations

from typing import Any

from flashcp.config.schema import Config
from flashcp.problems import Problem, as_fix


class DeviceError(RuntimeError):
    """A `run.device` / `train.dtype` no kernel of this machine runs: `error` names the key and
    the changes that fix it (a `Problem`, so preflight validates them like any other)."""

    def __init__(self, key: str, problem: str, fixes: list[dict[str, Any]]) -> None:
        self.error = Problem(key, problem, tuple(as_fix(f) for f in fixes))
        super().__init__(str(self.error))


def resolve_device(cfg: Config, gpu_visible: bool | None = None) -> str:
    """`cpu` or `gpu` for `run.device`: auto is gpu when `gpu_visible` (None: unknown, so
    cpu); gpu without a visible GPU (`gpu_visible` False) is refused (`DeviceError`)."""
    wanted = cfg.run.device
    if wanted == "gpu" and gpu_visible is False:
        on_cpu = {} if cfg.train.dtype != "bfloat16" else {"train.dtype": "auto"}
        raise DeviceError(
            "run.device",
            "gpu, but Paddle sees no GPU here (CPU build or no device)",
            [{"run.device": "auto", **on_cpu}, {"run.device": "cpu", **on_cpu}],
        )
    return "gpu" if wanted == "gpu" or (wanted == "auto" and bool(gpu_visible)) else "cpu"


def compute_dtype(cfg: Config, device: str, *, check: bool = True) -> str:
    """The compute dtype on `device`: `train.dtype`, with auto = bfloat16 on GPU, float32 on
    CPU. `check` refuses bfloat16 on CPU and float32 on a GPU: Paddle's
    FlashAttention/FlashMask CUDA kernels are registered for float16/bfloat16 only, so the
    first attention call would fail."""
    dtype = cfg.train.dtype
    if dtype == "auto":
        return "bfloat16" if device == "gpu" else "float32"
    if check and dtype == "bfloat16" and device != "gpu":
        raise DeviceError(
            "train.dtype",
            "bfloat16 needs a GPU and this run is on CPU",
            [{"train.dtype": "auto"}, {"train.dtype": "float32"}],
        )
    if check and dtype == "float32" and device == "gpu":
        raise DeviceError(
            "train.dtype",
            "float32 cannot run on this GPU: Paddle's FlashAttention/FlashMask kernels exist "
            "for float16/bfloat16 only",
            [{"train.dtype": "auto"}, {"train.dtype": "bfloat16"}, {"run.device": "cpu"}],
        )
    return dtype
