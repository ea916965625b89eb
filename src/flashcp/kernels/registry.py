"""Map (resolved FlashAttention version, device) to the backend that runs it.

`get_backend(version, device)` is the only place a kernel family is chosen from a version.
Callers resolve the version once (`flashcp.fa_dispatch.resolve_current`) and pass the same
value here for the forward and, later, for the backward, so the two can never disagree.

=========  ===========================  ================================================
device     version 2 / 3 / 4            backend
=========  ===========================  ================================================
cpu        any of 2, 3, 4               `CpuReferenceBackend` (the version is recorded only)
gpu/cuda   2                            `FA2Backend` (Paddle flashmask_attention / flash_attn)
gpu/cuda   3                            `FA3Backend` (Paddle flashmask_attention_v2 / v3)
gpu/cuda   4                            `FA4Backend` (CuTe `_flash_attn_fwd/_bwd`)
xpu        2                            `FA2Backend` (dispatch always resolves XPU to 2)
=========  ===========================  ================================================

Anything else (version outside 2-4, XPU with 3/4, unknown device) raises ValueError.
"""

from __future__ import annotations

from typing import Any

from flashcp.kernels.base import AttentionBackend
from flashcp.kernels.cpu_reference import CpuReferenceBackend
from flashcp.kernels.fa2 import FA2Backend
from flashcp.kernels.fa3 import FA3Backend
from flashcp.kernels.fa4 import FA4Backend

GPU_BACKENDS: dict[int, type] = {2: FA2Backend, 3: FA3Backend, 4: FA4Backend}
XPU_BACKENDS: dict[int, type] = {2: FA2Backend}
CPU_BACKEND: type = CpuReferenceBackend

_instances: dict[type, AttentionBackend] = {}


def device_kind(device: str) -> str:
    """The device kind, "cpu", "gpu" or "xpu", of a string such as "gpu:0", "cuda", "xpu:1"."""
    kind = str(device).strip().lower().split(":", 1)[0]
    if kind in ("gpu", "cuda"):
        return "gpu"
    if kind in ("cpu", "xpu"):
        return kind
    raise ValueError(
        f"device {device!r} is not supported: flashcp runs on 'cpu', 'gpu:N' (CUDA) or 'xpu:N'."
    )


def device_of(tensor: Any) -> str:
    """The Paddle device string of a tensor's place: "cpu", "gpu:N" or "xpu:N"."""
    place = tensor.place
    if place.is_gpu_place():
        return f"gpu:{place.gpu_device_id()}"
    if place.is_xpu_place():
        return f"xpu:{place.xpu_device_id()}"
    if place.is_cpu_place() or place.is_cuda_pinned_place():
        return "cpu"
    raise ValueError(f"tensor place {place} is not supported: use CPU, CUDA GPU or XPU tensors.")


def backend_class(version: int, device: str) -> type:
    """The backend class for a resolved version on a device (see the module table)."""
    if isinstance(version, bool) or version not in GPU_BACKENDS:
        raise ValueError(
            f"fa_version={version!r} is not a FlashAttention version: expected 2, 3 or 4 "
            "(resolve it with flashcp.fa_dispatch.resolve_current)."
        )
    kind = device_kind(device)
    if kind == "cpu":
        return CPU_BACKEND
    table = GPU_BACKENDS if kind == "gpu" else XPU_BACKENDS
    if version not in table:
        raise ValueError(f"fa_version={version} has no backend on {kind}: XPU only runs FA2.")
    return table[version]


def get_backend(version: int, device: str) -> AttentionBackend:
    """The (shared, stateless) backend instance for `version` on `device`."""
    cls = backend_class(version, device)
    inst = _instances.get(cls)
    if inst is None:
        inst = cls()
        _instances[cls] = inst
    return inst
