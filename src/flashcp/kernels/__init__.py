"""Attention kernels behind one contract (`AttentionBackend`), chosen by `get_backend`.

* `cpu_reference` - exact tiled FlashMask attention in numpy (any version on CPU);
* `fa2`, `fa3`, `fa4` - Paddle FA2 / FA3 ops and the CuTe FA4 kernels on GPU;
* `registry` - `get_backend(version, device)`, the one version -> backend mapping.
"""

from __future__ import annotations

from flashcp.kernels.base import AttentionBackend, default_scale, resolve_scale
from flashcp.kernels.cpu_reference import CpuReferenceBackend
from flashcp.kernels.fa2 import FA2Backend
from flashcp.kernels.fa3 import FA3Backend
from flashcp.kernels.fa4 import FA4Backend
from flashcp.kernels.registry import backend_class, device_of, get_backend

__all__ = [
    "AttentionBackend",
    "CpuReferenceBackend",
    "FA2Backend",
    "FA3Backend",
    "FA4Backend",
    "backend_class",
    "default_scale",
    "device_of",
    "get_backend",
    "resolve_scale",
]
