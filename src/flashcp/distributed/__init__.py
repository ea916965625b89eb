"""Distributed layer: rank layout, bootstrap, process groups and timed, counted collectives.

Typical use inside a launched worker::

    env = init_distributed()
    dims = ParallelDims(dp=1, pp=2, cp=2, world_size=env.world_size)
    groups = build_groups(dims)
    full = all_gather_tensor(local, groups.cp, axis=1)
    ...
    shutdown()

Names load on first use (PEP 562): the layout (`dims`) imports without Paddle, for the
planner. See `docs/distributed.md` for the layout, the gloo workarounds and the timeout behaviour.
"""

from __future__ import annotations

import importlib
from typing import Any

EXPORTS: dict[str, str] = {
    "Exchange": "flashcp.distributed.alltoall",
    "all_to_all": "flashcp.distributed.alltoall",
    "gather_rows": "flashcp.distributed.alltoall",
    "DistEnv": "flashcp.distributed.bootstrap",
    "init_distributed": "flashcp.distributed.bootstrap",
    "launch_env": "flashcp.distributed.bootstrap",
    "master_endpoint": "flashcp.distributed.bootstrap",
    "shutdown": "flashcp.distributed.bootstrap",
    "REDUCE_SCATTER_METHODS": "flashcp.distributed.collectives",
    "all_gather_object": "flashcp.distributed.collectives",
    "all_gather_tensor": "flashcp.distributed.collectives",
    "all_reduce_tensor": "flashcp.distributed.collectives",
    "barrier": "flashcp.distributed.collectives",
    "broadcast_tensor": "flashcp.distributed.collectives",
    "group_backend": "flashcp.distributed.collectives",
    "group_label": "flashcp.distributed.collectives",
    "nbytes": "flashcp.distributed.collectives",
    "reduce_scatter": "flashcp.distributed.collectives",
    "reduce_scatter_chunks": "flashcp.distributed.collectives",
    "ring_shift": "flashcp.distributed.collectives",
    "sends_first": "flashcp.distributed.collectives",
    "timeout_message": "flashcp.distributed.collectives",
    "COUNTERS": "flashcp.distributed.counters",
    "CommStats": "flashcp.distributed.counters",
    "comm_stats": "flashcp.distributed.counters",
    "reset_comm_stats": "flashcp.distributed.counters",
    "waited_seconds": "flashcp.distributed.counters",
    "DIM_ORDER": "flashcp.distributed.dims",
    "WORLD": "flashcp.distributed.dims",
    "ParallelDims": "flashcp.distributed.dims",
    "NamedGroup": "flashcp.distributed.groups",
    "ParallelGroups": "flashcp.distributed.groups",
    "build_groups": "flashcp.distributed.groups",
    "destroy_all_groups": "flashcp.distributed.groups",
    "destroy_groups": "flashcp.distributed.groups",
    "endpoint_host": "flashcp.distributed.groups",
    "start_group_store": "flashcp.distributed.groups",
    "store_group": "flashcp.distributed.groups",
    "wait_for_port": "flashcp.distributed.groups",
    "world_group": "flashcp.distributed.groups",
    "ENV_INIT_TIMEOUT": "flashcp.distributed.watchdog",
    "ENV_STARTUP_TIMEOUT": "flashcp.distributed.watchdog",
    "ENV_SYNC": "flashcp.distributed.watchdog",
    "ENV_TIMEOUT": "flashcp.distributed.watchdog",
    "TIMEOUT_EXIT_CODE": "flashcp.distributed.watchdog",
    "WATCHDOG": "flashcp.distributed.watchdog",
    "Watchdog": "flashcp.distributed.watchdog",
    "resolve_timeout": "flashcp.distributed.watchdog",
    "startup_phase": "flashcp.distributed.watchdog",
}
"""Each name → the module that defines it."""

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    """A name of `EXPORTS`, imported from its module on first use."""
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashcp.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
