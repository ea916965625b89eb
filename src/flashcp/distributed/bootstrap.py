"""Start and stop the distributed runtime of one launched process.

`init_distributed` reads the launcher's environment, waits until rank 0's TCPStore accepts
connections, then calls `paddle.distributed.init_parallel_env()` under the watchdog. Waiting
first matters: Paddle's store client sleeps a fixed 3 s after a refused connection, and under
`paddle.distributed.launch` the non-zero ranks usually start before rank 0 listens.
`shutdown` releases flashcp's groups in an order that lets every process exit cleanly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import paddle.distributed as dist

from flashcp.distributed.collectives import barrier
from flashcp.distributed.groups import destroy_all_groups, wait_for_port, world_group
from flashcp.distributed.watchdog import WATCHDOG, resolve_timeout
from flashcp.log import logger


@dataclass(frozen=True)
class DistEnv:
    """What the launcher told this process (and whether Paddle is initialised)."""

    rank: int
    world_size: int
    master: str | None
    backend: str
    initialized: bool = False
    nnodes: int = 1
    """Nodes of the job (`PADDLE_NNODES`, set by the launcher's `--nnodes`)."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int_env(*keys: str, default: int) -> int:
    for key in keys:
        raw = os.environ.get(key, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
    return default


def master_endpoint() -> str | None:
    """`host:port` of rank 0's store, as `init_parallel_env` will resolve it."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"{addr}:{port}"
    if os.environ.get("PADDLE_MASTER"):
        return os.environ["PADDLE_MASTER"]
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "")
    return endpoints.split(",")[0] or None


def launch_env() -> DistEnv:
    """The rank / world size / master endpoint set by `paddle.distributed.launch`."""
    world = _int_env("PADDLE_TRAINERS_NUM", "WORLD_SIZE", default=1)
    rank = _int_env("PADDLE_TRAINER_ID", "RANK", default=0)
    if not 0 <= rank < max(world, 1):
        raise ValueError(f"rank {rank} is outside 0..{world - 1} (check the launcher env)")
    backend = os.environ.get("PADDLE_DISTRI_BACKEND", "auto")
    nnodes = _int_env("PADDLE_NNODES", default=1)
    return DistEnv(rank, world, master_endpoint(), backend, dist.is_initialized(), max(nnodes, 1))


def init_distributed(timeout: float | None = None) -> DistEnv:
    """Initialise Paddle's parallel env once; later calls just return the state.

    A single process (no launcher, or one rank) is not initialised and gets rank 0 / world 1.
    `timeout` (else `FLASHCP_INIT_TIMEOUT`, default 300 s) bounds both the wait for the master
    store and `init_parallel_env` itself. `PADDLE_PG_TIMEOUT` (NCCL groups' own timeout, ms)
    defaults to the collective timeout when unset.
    """
    env = launch_env()
    if not env.is_distributed or env.initialized:
        return env
    seconds = resolve_timeout(timeout, init=True)
    if env.rank != 0 and env.master:
        host, port = env.master.rsplit(":", 1)
        waited = wait_for_port(host, int(port), seconds, what=f"rank 0's store (rank {env.rank})")
        logger.debug("rank %d: master %s reachable after %.2f s", env.rank, env.master, waited)
    # NCCL process groups read their own timeout (ms) from this when init_parallel_env runs.
    os.environ.setdefault("PADDLE_PG_TIMEOUT", str(int(resolve_timeout() * 1000)))
    message = (
        f"[flashcp] init_parallel_env timed out after {seconds:g} s on rank {env.rank} "
        f"(master {env.master}, world {env.world_size}): some rank did not start or died"
    )
    with WATCHDOG.watch(seconds, message):
        dist.init_parallel_env()
    return DistEnv(
        dist.get_rank(),
        dist.get_world_size(),
        env.master,
        env.backend,
        dist.is_initialized(),
        env.nnodes,
    )


_final_barrier_done = False


def shutdown(timeout: float | None = None) -> None:
    """Release flashcp's groups and meet every rank once more (collective; idempotent).

    The final world barrier (once per process) keeps rank 0, which hosts the job's store,
    alive until every rank is done with it, so no process sees its store vanish mid-call.
    """
    global _final_barrier_done
    destroy_all_groups(timeout=timeout)
    if not _final_barrier_done and dist.is_initialized() and dist.get_world_size() > 1:
        barrier(world_group(), timeout=timeout)
        _final_barrier_done = True
