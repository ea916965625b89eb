"""Per-rank byte counters for flashcp collectives.

Every wrapped collective adds the payload bytes *this rank* sends and receives, keyed by
operation and group label, so a benchmark can compare measured traffic with the theoretical
cost, e.g. (cp - 1) / cp · size for an all-gather or a ring reduce-scatter.

Counted at the transfer (from the tensors handed to the `paddle.distributed` call, never from
a formula of the problem size): `send` / `recv`, `ring_shift` and the ring reduce-scatter (the
nbytes of every tensor their send/recv calls move), and `all_gather` (received: the nbytes of
the parts the call returned from the other ranks; sent: the input's nbytes once per other rank
it was delivered to). Collectives whose algorithm runs inside the library (`all_reduce`,
`broadcast`, the NCCL and all-reduce reduce-scatter variants) count its bandwidth-optimal
model applied to the tensors handed to it (see `docs/distributed.md`).

Every call that waits on other ranks also adds the seconds this process spent inside it
(`waited_seconds`): the part of a rank's busy time it spent waiting for its peers (or moving
bytes), which the straggler watch takes out of it (`flashcp.metrics.straggler`). On NCCL a
call returns once its work is queued, so the device's own waiting is not in it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class CommStats:
    """Totals for one (operation, group) key, or a sum over several."""

    calls: int = 0
    sent: int = 0
    received: int = 0

    def __iadd__(self, other: CommStats) -> CommStats:
        self.calls += other.calls
        self.sent += other.sent
        self.received += other.received
        return self


class CommCounters:
    """Thread-safe accumulator of `CommStats` keyed by `(op, group_label)`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], CommStats] = {}
        self._waited = 0.0

    def add_wait(self, seconds: float) -> None:
        """Add `seconds` spent inside a waiting call."""
        with self._lock:
            self._waited += float(seconds)

    @property
    def waited(self) -> float:
        """Seconds spent inside waiting calls since the start (never reset)."""
        with self._lock:
            return self._waited

    def record(self, op: str, group: str, *, sent: int, received: int) -> None:
        with self._lock:
            stats = self._stats.setdefault((op, group), CommStats())
            stats += CommStats(1, int(sent), int(received))

    def total(self, op: str | None = None, group: str | None = None) -> CommStats:
        """Sum over keys matching `op` and `group` (None matches everything)."""
        out = CommStats()
        with self._lock:
            for (key_op, key_group), stats in self._stats.items():
                if (op is None or key_op == op) and (group is None or key_group == group):
                    out += stats
        return out

    def snapshot(self) -> dict[tuple[str, str], CommStats]:
        with self._lock:
            return {key: CommStats(s.calls, s.sent, s.received) for key, s in self._stats.items()}

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()


COUNTERS = CommCounters()


def comm_stats(op: str | None = None, group: str | None = None) -> CommStats:
    """Bytes this process sent/received in flashcp collectives (filter by op / group label)."""
    return COUNTERS.total(op, group)


def waited_seconds() -> float:
    """Seconds this process has spent inside flashcp's waiting calls (collectives, send/recv)."""
    return COUNTERS.waited


def reset_comm_stats() -> None:
    COUNTERS.reset()
