"""What the machine was doing while a benchmark ran: the load average around a measurement,
the busy cores of the whole machine, and the CPU model. Other jobs share these cores, so every
page records the load next to the times it reports."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages (empty where the OS has none)."""
    try:
        return list(os.getloadavg())
    except OSError:  # pragma: no cover - every Linux has it
        return []


@dataclass
class Load:
    """The load average just before and just after one measurement."""

    before: list[float]
    after: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[float]]:
        """The JSON shape the pages read: `loadavg_before`, `loadavg_after`."""
        return {"loadavg_before": self.before, "loadavg_after": self.after}


@contextmanager
def load_window() -> Iterator[Load]:
    """`with load_window() as load:` records the load average before and after the block."""
    load = Load(loadavg())
    try:
        yield load
    finally:
        load.after = loadavg()


def cpu_jiffies() -> tuple[int, int, int]:
    """Machine-wide (busy, total) CPU jiffies from `/proc/stat` and the number of CPUs.

    Two readings give the busy cores in between: (busy1 - busy0) / (total1 - total0) · CPUs,
    every process on the machine counted. (-1, -1, 0) where `/proc/stat` is missing.
    """
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return -1, -1, 0
    values = [int(x) for x in lines[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    ncpu = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(values[:8]) - idle, sum(values[:8]), ncpu


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
