"""Distributed layer: rank layout, bootstrap, process groups and timed, counted collectives.

Typical use inside a launched worker::

    env = init_distributed()
    dims = ParallelDims(dp=1, pp=2, cp=2, world_size=env.world_size)
    groups = build_groups(dims)
    full = all_gather_tensor(local, groups.cp, axis=1)
    ...
    shutdown()

See `docs/distributed.md` for the layout, the gloo workarounds and the timeout behaviour.
"""

from flashcp.distributed.alltoall import Exchange, all_to_all, gather_rows
from flashcp.distributed.bootstrap import (
    DistEnv,
    init_distributed,
    launch_env,
    master_endpoint,
    shutdown,
)
from flashcp.distributed.collectives import (
    REDUCE_SCATTER_METHODS,
    all_gather_object,
    all_gather_tensor,
    all_reduce_tensor,
    barrier,
    broadcast_tensor,
    group_backend,
    group_label,
    nbytes,
    reduce_scatter,
    reduce_scatter_chunks,
    ring_shift,
    sends_first,
    timeout_message,
)
from flashcp.distributed.counters import (
    COUNTERS,
    CommStats,
    comm_stats,
    reset_comm_stats,
    waited_seconds,
)
from flashcp.distributed.dims import DIM_ORDER, WORLD, ParallelDims
from flashcp.distributed.groups import (
    NamedGroup,
    ParallelGroups,
    build_groups,
    destroy_all_groups,
    destroy_groups,
    endpoint_host,
    start_group_store,
    store_group,
    wait_for_port,
    world_group,
)
from flashcp.distributed.watchdog import (
    ENV_INIT_TIMEOUT,
    ENV_STARTUP_TIMEOUT,
    ENV_SYNC,
    ENV_TIMEOUT,
    TIMEOUT_EXIT_CODE,
    WATCHDOG,
    Watchdog,
    resolve_timeout,
    startup_phase,
)

__all__ = [
    "COUNTERS",
    "DIM_ORDER",
    "ENV_INIT_TIMEOUT",
    "ENV_STARTUP_TIMEOUT",
    "ENV_SYNC",
    "ENV_TIMEOUT",
    "REDUCE_SCATTER_METHODS",
    "TIMEOUT_EXIT_CODE",
    "WATCHDOG",
    "WORLD",
    "CommStats",
    "DistEnv",
    "Exchange",
    "NamedGroup",
    "ParallelDims",
    "ParallelGroups",
    "Watchdog",
    "all_gather_object",
    "all_to_all",
    "all_gather_tensor",
    "all_reduce_tensor",
    "barrier",
    "broadcast_tensor",
    "build_groups",
    "comm_stats",
    "destroy_all_groups",
    "destroy_groups",
    "endpoint_host",
    "gather_rows",
    "group_backend",
    "group_label",
    "init_distributed",
    "launch_env",
    "master_endpoint",
    "nbytes",
    "reduce_scatter",
    "reduce_scatter_chunks",
    "reset_comm_stats",
    "resolve_timeout",
    "ring_shift",
    "sends_first",
    "shutdown",
    "startup_phase",
    "start_group_store",
    "store_group",
    "waited_seconds",
    "timeout_message",
    "wait_for_port",
    "world_group",
]
