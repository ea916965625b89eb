"""What a launch's output shows on `flashcp train`'s console, and what stays in the log files.

The launcher's output is copied whole to `<run.output_dir>/logs/launcher.log` (`pump`) and,
but for its configuration banner, Paddle's C++ INFO lines and known notices (`shown`), to the
console. The launcher echoes rank 0's log every 2 s, and not at all once it is stopped or a
rank failed; `RankZeroEcho` follows what it echoed so the lines it never did (the save of a
pre-emption, the summary of the run) follow when the launch ends (`flashcp.launch.launcher`).
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import TextIO

from flashcp.launch import outcome

_HIDDEN_PREFIXES = ("LAUNCH INFO", "FLAGS(name=", "=====")
_NOISE = (
    "No ccache found",
    "warnings.warn(warning_message)",
    "Modified FLAGS detected",
    " - HTTP Request: ",  # the launchers' rendezvous polls (multi-node)
)
_GLOG_INFO = re.compile(r"^I\d{4} ")  # glog INFO lines from Paddle's C++ side
_LAUNCHER_FAILED = "Container failed !!!"
"""After this line the launcher re-prints the failed rank's log tail (`failure_report` says it)."""


def shown(line: str) -> bool:
    """Whether a line of the launcher's output (or of rank 0's log) reaches the console."""
    return not (
        line.startswith(_HIDDEN_PREFIXES)
        or _GLOG_INFO.match(line)
        or outcome.EXIT_LINE_RE.match(line)
        or any(n in line for n in _NOISE)
    )


class RankZeroEcho:
    """How far the launcher has echoed rank 0's log (this launch's part, from `offset`):
    Paddle's launcher copies its first rank's new lines to its output every 2 s, and stops
    copying when it is stopped or a rank fails, so the last lines rank 0 wrote — the save of a
    pre-emption, the summary of the run — may never reach the console. `saw` is fed the
    launcher's output line by line (a line that is rank 0's next one moves the mark on);
    `rest` is what it never echoed."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset = path, offset
        self._file: TextIO | None = None
        self._pending = ""

    def _next(self) -> str | None:
        """Rank 0's next whole line (not consumed), None when there is none yet."""
        if self._file is None:
            try:
                raw = open(self.path, "rb")  # noqa: SIM115 - kept open while the launch runs
            except OSError:
                return None
            raw.seek(self.offset)
            self._file = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        while not self._pending.endswith("\n"):
            more = self._file.readline()
            if not more:
                return None
            self._pending += more
        return self._pending

    def saw(self, line: str) -> None:
        """The launcher printed `line`: if it is rank 0's next one, it is echoed."""
        if self._next() == line:
            self._pending = ""

    def rest(self) -> list[str]:
        """Rank 0's lines the launcher did not echo (then closes the log)."""
        lines = []
        while (line := self._next()) is not None:
            lines.append(line)
            self._pending = ""
        if self._pending:  # a last line without its newline
            lines.append(self._pending + "\n")
            self._pending = ""
        if self._file is not None:
            self._file.close()
            self._file = None
        return lines


def pump(src: TextIO, log: TextIO, out: TextIO, echo: RankZeroEcho | None = None) -> None:
    """Copy the launcher's output to `launcher.log`, and all but its banner to `out`; until a
    rank fails (the launcher then re-prints a failed rank's log tail), tell `echo` each line."""
    failed = False
    for line in src:
        log.write(line)
        log.flush()
        failed = failed or _LAUNCHER_FAILED in line
        if failed:
            continue
        if echo is not None:
            echo.saw(line)
        if shown(line):
            out.write(line)
            out.flush()
