"""`flashcp.host_alloc`: freed host memory is reused, not faulted in again, once retained."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from typing import Any

import pytest

from flashcp import host_alloc

_PROBE = """
import json, resource, sys
import paddle
from flashcp import host_alloc
from flashcp.rank_setup import use_device
if sys.argv[1] in ("retain", "restored"):
    use_device("cpu")  # what a CPU run's trainer and evaluation call
if sys.argv[1] == "restored":
    host_alloc.system_defaults()  # the benchmark's "before"
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = paddle.full([64 * 2**20 // 4], 1.0, dtype="float32")  # 64 MiB, written once
    del buf
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "retained": host_alloc._done[0]}))
"""

PAGES = 64 * 2**20 // 4096
"""4 KiB pages of one 64 MiB buffer."""


def _faults(mode: str) -> dict[str, Any]:
    cmd = [sys.executable, "-c", _PROBE, mode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_run_reuses_freed_buffers_instead_of_faulting_them_in_again() -> None:
    """Allocating, filling and freeing a 64 MiB tensor four times: by default glibc maps and
    unmaps it each time, so each round faults in every page (the negative control); once a CPU
    run's `use_device("cpu")` retained freed memory, the later rounds reuse the first round's
    pages and fault in almost none; `system_defaults` undoes it. (Outside glibc nothing is
    done, and said: False.)"""
    if platform.libc_ver()[0] != "glibc":
        assert host_alloc.retain_freed_memory() is False
        return
    default = _faults("default")
    assert not default["retained"]
    assert all(f > 0.9 * PAGES for f in default["faults"][1:]), default
    kept = _faults("retain")
    assert kept["retained"]
    assert kept["faults"][0] > 0.9 * PAGES  # the first round still maps its pages once
    assert all(f < 0.05 * PAGES for f in kept["faults"][1:]), kept
    restored = _faults("restored")  # glibc's defaults back: every round faults again
    assert not restored["retained"]
    assert all(f > 0.9 * PAGES for f in restored["faults"][1:]), restored


def test_retained_once_per_process_undone_by_the_defaults_and_refused_outside_glibc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`retain_freed_memory` asks glibc once (no mmap per block, a 2 GiB trim threshold) unless
    told `again`; `system_defaults` asks for glibc's defaults and forgets it was done; without
    glibc nothing is asked and both say False."""
    calls: list[dict[int, int]] = []
    real = host_alloc._mallopt
    monkeypatch.setattr(host_alloc, "_mallopt", lambda values: calls.append(dict(values)) or True)
    monkeypatch.setattr(host_alloc, "_done", [False])
    keep = {host_alloc.M_MMAP_MAX: 0, host_alloc.M_TRIM_THRESHOLD: 2**31 - 1}
    assert host_alloc.retain_freed_memory() and host_alloc.retain_freed_memory()
    assert calls == [keep]  # once
    assert host_alloc.system_defaults() and not host_alloc._done[0]
    assert calls[-1] == {host_alloc.M_MMAP_MAX: 65536, host_alloc.M_TRIM_THRESHOLD: 128 * 1024}
    assert host_alloc.retain_freed_memory() and calls[-1] == keep  # asked again after that
    assert host_alloc.retain_freed_memory(again=True) and calls[-2:] == [keep, keep]
    monkeypatch.setattr(host_alloc, "_mallopt", real)
    monkeypatch.setattr(host_alloc, "_done", [False])
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_alloc.retain_freed_memory() is False and host_alloc.system_defaults() is False
