"""Paddle's launcher draws every rendezvous port from the lease flashcp gives it.

`run_launch` and `flashcp train` lease ports (`flashcp.distributed.ports`) and pass them as
`PORT_RANGE`; this checks, on a real 2-process launch, that Paddle's launcher honours it: the
master store (`PADDLE_MASTER`) and every trainer endpoint lie in the lease, outside the kernel's
ephemeral range, and are distinct. A gloo group store started in a worker is leased too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp.distributed import ports
from flashcp.distributed.groups import start_group_store
from helpers.launch import run_launch

pytestmark = pytest.mark.integration

WORKER = Path(__file__).parent / "workers" / "env_worker.py"


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.timeout(120)
def test_launcher_ports_come_from_the_lease() -> None:
    result = run_launch(WORKER, 2, timeout=90)
    assert result.ok, result.summary()
    first, last = (int(x) for x in result.port_range.split(":"))
    low, high = ports.ephemeral_range()
    assert last < low or first > high, (result.port_range, (low, high))
    seen = []
    for rank in range(2):
        (line,) = [x for x in result.log(rank).splitlines() if x.startswith("ENV ")]
        env = json.loads(line.removeprefix("ENV "))
        master = _port(env["PADDLE_MASTER"])
        endpoints = [_port(e) for e in env["PADDLE_TRAINER_ENDPOINTS"].split(",")]
        assert first <= master <= last and all(first <= p <= last for p in endpoints), env
        assert len({master, *endpoints}) == 3, env  # the store and two endpoints, all distinct
        seen.append((master, endpoints))
    assert seen[0] == seen[1]  # one job, one rendezvous


@pytest.mark.timeout(60)
def test_group_store_port_is_leased_outside_the_ephemeral_range() -> None:
    box, port, thread = start_group_store("127.0.0.1", 1, 10.0)
    thread.join(10)
    assert "store" in box, box
    low, high = ports.ephemeral_range()
    first, last = ports.rendezvous_window()
    assert first <= port <= last and not low <= port <= high
    with pytest.raises(RuntimeError, match="free ports"):  # lease dropped, the store binds it
        ports.reserve(1, window=(port, port))
