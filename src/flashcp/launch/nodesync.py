"""The restart rendezvous of a job's nodes: every node's `flashcp train` stops, reports, and
relaunches together, agreeing through the run directory they share.

Files under `<run.output_dir>/logs/restarts/` (written whole, by rename):

* `attempt<K>.node<R>.json`: node R's `Report` of launch attempt K, written when its launcher
  exited. A node whose launcher still runs when another node's failure report appears stops
  its own (its ranks would only wait for the lost peers until the watchdog ends them).
* `attempt<K>.decision.json`: node 0's `Decision` from every node's report (`decide`), with the
  overrides of the relaunch (the checkpoint to resume from: the same on every node). Node 0
  waits for the reports up to the init timeout (`FLASHCP_INIT_TIMEOUT`); a node that never
  reports is lost, and the job stops. The other nodes follow the decision: relaunch attempt
  K + 1 after the same backoff, or exit with its code.

Node 0 clears the directory before its first launch; the other nodes start after its
launcher serves the `--master` port (`flashcp.launch.preflight.check_master`), so nothing of an
earlier `flashcp train` is read. Paddle's own rendezvous then meets at `--master` again: node 0
writes a decision only after its launcher (which serves that port) has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashcp import rundir
from flashcp.launch.restart import Decision, Report

POLL_SECONDS = 0.5


class NodeSync:
    """Node `node` of `nodes` agreeing with the others about restarts (module docstring)."""

    def __init__(self, output_dir: str | Path, node: int, nodes: int) -> None:
        self.dir = Path(output_dir) / rundir.LOG_DIR / rundir.SYNC_DIR
        self.node, self.nodes = node, nodes

    def _path(self, attempt: int, who: str) -> Path:
        return self.dir / f"attempt{attempt}.{who}.json"

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    def reset(self) -> None:
        """Node 0, before its first launch: drop the files of an earlier `flashcp train`."""
        if self.node != 0 or not self.dir.is_dir():
            return
        for entry in self.dir.iterdir():
            with contextlib.suppress(OSError):
                entry.unlink()

    def report(self, attempt: int, report: Report) -> None:
        """This node's report of `attempt`."""
        self._write(self._path(attempt, f"node{self.node}"), report.to_json())

    def failed_elsewhere(self, attempt: int) -> Report | None:
        """Another node's report that `attempt` failed there (None: none yet)."""
        for node in range(self.nodes):
            if node == self.node:
                continue
            data = self._read(self._path(attempt, f"node{node}"))
            if data is not None and data.get("code", 0) != 0:
                return Report.from_json(data)
        return None

    def reports(self, attempt: int, timeout: float, stop: Callable[[], bool] = lambda: False
                ) -> dict[int, Report | None]:  # fmt: skip
        """Node 0: every node's report of `attempt`, waiting up to `timeout` s for them (None
        for a node that did not report: lost); `stop()` true ends the wait early."""
        deadline = time.monotonic() + timeout
        got: dict[int, Report | None] = dict.fromkeys(range(self.nodes))
        while True:
            for node in range(self.nodes):
                if got[node] is None and (data := self._read(self._path(attempt, f"node{node}"))):
                    got[node] = Report.from_json(data)
            if all(r is not None for r in got.values()) or time.monotonic() > deadline or stop():
                return got
            time.sleep(POLL_SECONDS)

    def publish(self, attempt: int, decision: Decision, overrides: list[str],
                resume_step: int | None) -> None:  # fmt: skip
        """Node 0: the decision after `attempt`, with the relaunch's overrides."""
        data = {**decision.to_json(), "overrides": overrides, "resume_step": resume_step}
        self._write(self._path(attempt, "decision"), data)

    def decision(self, attempt: int, timeout: float, stop: Callable[[], bool] = lambda: False
                 ) -> tuple[Decision, list[str], int | None] | None:  # fmt: skip
        """The other nodes: node 0's decision after `attempt` (None: none within `timeout` s,
        node 0 is lost, or `stop()` became true)."""
        deadline = time.monotonic() + timeout
        path = self._path(attempt, "decision")
        while time.monotonic() <= deadline and not stop():
            if (data := self._read(path)) is not None:
                return Decision.from_json(data), list(data["overrides"]), data["resume_step"]
            time.sleep(POLL_SECONDS)
        return None
