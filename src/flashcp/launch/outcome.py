"""How a rank ends, and how a failed job is explained: the contract between the ranks
(`flashcp.launch.worker`) and the supervisor (`flashcp.launch.job`).

A rank exits with one of the `EXIT_*` codes and prints `EXIT_LINE` as its last line (after
the process groups are torn down), so its log tells a rank that finished from one that was
killed. When a job fails, `failure_report` reads each rank's log (the part written by this
launch) and the launcher's output and says which rank failed first and how — killed without a
word (SIGKILL, the OOM killer), crashed on a signal, exited with its own error, timed out in a
collective — and which ranks only went down with it, followed by the failed rank's last log
lines. Pure text: nothing here starts, waits for or signals a process.
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flashcp.distributed.watchdog import TIMEOUT_EXIT_CODE
from flashcp.rundir import worker_log

EXIT_OK = 0
"""Done: trained, evaluated, validated, planned within the budget."""
EXIT_NO_FIT = 1
"""`flashcp plan`: the plan does not fit (or `--longest` finds no length that does)."""
EXIT_CONFIG = 2
"""A bad config, fault spec, or a run directory the run may not start in (before init)."""
EXIT_NONFINITE = 3
"""Non-finite loss or gradients (`train.on_nonfinite: stop`)."""
EXIT_CHECKPOINT = 4
"""A broken checkpoint was asked for (or a restart's checkpoint failed its checksum)."""
EXIT_DATA = 5
"""Bad data the ranks met (`flashcp.data.records.DataError`: a bad record under
`data.on_bad_record: error`, a row that fails to read, no usable record) — what the preflight's
data check did not already refuse (exit 2)."""
EXIT_PREEMPTED = 75
"""Pre-empted (SIGTERM or `run.preempt_signal`): every rank finished its step, saved a
checkpoint and stopped; run the same command again to resume (sysexits' EX_TEMPFAIL)."""
EXIT_HANG = TIMEOUT_EXIT_CODE
"""A rank the collective watchdog ended: a peer dead, hung or skipping a collective (its log
names the collective and the peer it waited for)."""
EXIT_SIGNAL_BASE = 128
"""A job stopped by a signal exits 128 + its number: 130 after Ctrl-C (SIGINT), 143 after a
stop by SIGTERM beyond the pre-emption's grace."""
EXIT_CODES: dict[str, str] = {
    str(EXIT_OK): "done",
    str(EXIT_NO_FIT): "`flashcp plan`: the plan does not fit the budget (or `--longest` finds "
    "no length that does)",
    str(EXIT_CONFIG): "a bad config, command line, model directory, data sample or run "
    "directory (another job holds it), refused before anything is launched or computed",
    str(EXIT_NONFINITE): "a non-finite loss or gradients (`train.on_nonfinite: stop`)",
    str(EXIT_CHECKPOINT): "a broken checkpoint, or a failed save with "
    "`checkpoint.fail_on_error`",
    str(EXIT_DATA): "bad data the ranks met (`data.on_bad_record: error`, a row that fails to "
    "read, no usable record)",
    str(EXIT_PREEMPTED): "pre-empted: every rank saved and stopped; run the same command "
    "again to resume",
    str(EXIT_HANG): "a rank ended by the collective watchdog: a peer dead, hung or skipping a "
    "collective (its log names which)",
    "128 + N": "stopped by signal N (130: Ctrl-C, after saving); every rank ended with it",
}
"""THE table of flashcp's exit codes, every command's (`docs/training.md`, "Exit codes", is
checked against it: `tests/unit/launch/test_outcome.py`)."""
FINAL_CODES: dict[int, str] = {
    EXIT_CONFIG: "a refused config",
    EXIT_NONFINITE: "a non-finite loss",
    EXIT_CHECKPOINT: "a broken checkpoint",
    EXIT_DATA: "bad data",
    EXIT_PREEMPTED: "a pre-emption",
}
"""Exit codes a relaunch cannot change: an automatic restart never follows them."""
EXIT_LINE = "[flashcp] rank {rank} exit {code}"
"""Each rank's last line in its log."""
EXIT_LINE_RE = re.compile(r"^\[flashcp\] rank (\d+) exit (-?\d+)\s*$", re.M)
"""`EXIT_LINE` as the supervisor reads it: (rank, code)."""
SIGNAL_NOTED = "[flashcp] rank {rank} got signal {signum}: it stops after the step in progress"
"""What a rank logs the moment a pre-emption signal reaches it (`flashcp.launch.preempt`), even
while it waits inside a collective: a rank the launcher stops and then kills is told apart from
one killed without a word."""
SIGNAL_NOTED_RE = re.compile(r"^\[flashcp\] rank \d+ got signal \d+: ", re.M)
TAIL_LINES = 12

_CONTAINER = re.compile(r"Container rank (\d+) status \w+ .*? code (-?\d+) log ")
_WATCHDOG = re.compile(r"^\[flashcp\] .* timed out after .*$", re.M)
_FATAL = re.compile(r"\*\*\* (SIG[A-Z]+) \(@0x[0-9a-f]+\) received by PID")
_ABORT = re.compile(r"^.*(?:Assertion .* failed|terminate called|core dumped).*$", re.M)
_PEER_LOST = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Socket closed|"
    r"Connection refused|ECONNRESET|EPIPE|TIMEOUT self_rank = \d+ pair_rank",
    re.I,
)
_ERROR = re.compile(
    r"^(\[rank \d+\] error: .*|(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b: .+)$", re.M
)
_WRAPPED = re.compile(r"^\s+((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b: .+)$", re.M)
"""The error Paddle wraps in `OSError: (External)` when it was raised inside an autograd node's
backward (a PyLayer: attention, the MoE exchange), indented under 'Error message in backward'."""
_PY_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.M)
_RANK_TAG = re.compile(r"\[rank \d+\] ")
SEVERITY = (
    "killed", "hung", "signal", "error", "timeout", "peer", "stopped", "finished", "unknown",
)  # fmt: skip
"""Kinds of ending, the most telling first: the rank to blame for a failed job."""


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of a failed job ended, as its log and the launcher tell it."""

    rank: int
    kind: str
    """One of `SEVERITY`: killed (no word: SIGKILL, OOM), hung (did not reach the collective
    the others timed out in), signal (fatal signal), error (own non-zero exit), timeout
    (watchdog), peer (lost a peer), stopped (by the launcher), finished (exit 0), unknown (no
    log)."""
    text: str
    """The sentence that explains it."""
    code: int | None = None
    """The code the rank's own `EXIT_LINE` gave (None: it wrote none)."""


def _signal_name(code: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def classify_rank(rank: int, log: str | None, launcher_code: int | None = None) -> RankOutcome:
    """What `log` (this launch's part of `workerlog.<rank>`) says about how the rank ended.

    `launcher_code` is the rank's exit code when the launcher reported it (negative: signal).
    """
    if log is None:
        return RankOutcome(rank, "unknown", "wrote no log")
    exits = EXIT_LINE_RE.findall(log)
    code = int(exits[-1][1]) if exits else None
    fatal = [name for name in _FATAL.findall(log) if name != "SIGTERM"]
    abort = _ABORT.search(log)
    if fatal or abort:
        what = f"crashed with {fatal[-1]}" if fatal else f"aborted ({abort.group(0).strip()})"
        when = " after finishing its work (at exit)" if code == 0 else ""
        return RankOutcome(rank, "signal", what + when)
    if code is None and (timeout := _WATCHDOG.findall(log)):
        return RankOutcome(rank, "timeout", f"was ended by the watchdog: {timeout[-1].strip()}")
    if code == 0:
        return RankOutcome(rank, "finished", "finished (exit 0)")
    tracebacks = [m.start() for m in _PY_TRACEBACK.finditer(log)]
    if code is not None or tracebacks:
        # The exception line that ends the last Python traceback, else the rank's last error.
        failure = log[tracebacks[-1] :] if tracebacks else log
        errors = _ERROR.findall(failure)
        last_error = (errors[0] if tracebacks else errors[-1]).strip() if errors else ""
        if last_error.startswith("OSError: (External)") and (inner := _WRAPPED.search(failure)):
            last_error = inner.group(1).strip()  # what the backward node raised
        if lost := _PEER_LOST.search(failure):
            start = failure.rfind("\n", 0, lost.start()) + 1
            end = failure.find("\n", lost.end())
            line = failure[start : end if end >= 0 else None].strip()
            return RankOutcome(rank, "peer", f"lost its connection to a peer ({line})")
        what = f"exited with code {code}" if code is not None else "raised an exception"
        return RankOutcome(rank, "error", what + (f": {last_error}" if last_error else ""), code)
    if _FATAL.search(log) or SIGNAL_NOTED_RE.search(log):  # SIGTERM, nothing of its own before
        return RankOutcome(rank, "stopped", "was stopped by the launcher (SIGTERM)")
    if launcher_code is not None and launcher_code > 0:
        return RankOutcome(rank, "error", f"exited with code {launcher_code} without an error")
    how = (
        f"the launcher saw exit code {launcher_code}: {_signal_name(launcher_code)}"
        if launcher_code is not None and launcher_code < 0
        else "killed from outside: SIGKILL or the out-of-memory killer?"
    )
    return RankOutcome(rank, "killed", f"died without writing an error ({how})")


def launcher_codes(launcher_output: str) -> dict[int, int]:
    """Exit codes of failed ranks reported by the launcher (`Container rank N ... code C`)."""
    return {int(r): int(c) for r, c in _CONTAINER.findall(launcher_output)}


def _after_first(outcome: RankOutcome, codes: Mapping[int, int], hang: bool) -> RankOutcome:
    """A rank that left without a word or was stopped, when the launcher's failure was the
    watchdog's (`hang`): it never reached the collective its peers timed out in — it hung (or
    died without a word where no connection reset told its peers)."""
    if not hang or outcome.kind not in ("killed", "stopped") or outcome.rank in codes:
        return outcome
    first = min(codes)
    return RankOutcome(outcome.rank, "hung", f"did not reach the collective rank {first} timed "
                       "out in (hung), and was stopped by the launcher")  # fmt: skip


def diagnose(logs: Mapping[int, str | None], launcher_output: str = "") -> list[RankOutcome]:
    """Every rank's outcome, the rank to blame first (then by rank)."""
    codes = launcher_codes(launcher_output)
    outcomes = [classify_rank(r, logs[r], codes.get(r)) for r in sorted(logs)]
    timed_out = {o.rank for o in outcomes if o.kind == "timeout"}
    hang = bool(codes) and all(r in timed_out for r in codes)
    outcomes = [_after_first(o, codes, hang) for o in outcomes]
    return sorted(outcomes, key=lambda o: (SEVERITY.index(o.kind), o.rank))


CAUSES: dict[str, str] = {
    "killed": "killed",
    "hung": "hang",
    "timeout": "hang",
    "signal": "crash",
    "error": "error",
    "peer": "peer lost",
    "stopped": "stopped",
    "unknown": "unknown",
    "finished": "unknown",
}
"""The cause a restart record gives for the blamed rank's kind of ending."""


@dataclass(frozen=True)
class Verdict:
    """Why a failed launch ended and whether a relaunch can help."""

    code: int
    """The job's exit code (`job_code`)."""
    cause: str
    """One of `CAUSES`' values: killed, hang, crash, error, peer lost, stopped, unknown."""
    rank: int | None
    """The job rank to blame (None: no rank's log said anything)."""
    text: str
    """What happened to it (`RankOutcome.text`)."""
    kind: str = "unknown"
    """Its `RankOutcome.kind` (`SEVERITY`)."""

    @property
    def final(self) -> str | None:
        """What a relaunch cannot fix (`FINAL_CODES`), None when a restart may help."""
        return FINAL_CODES.get(self.code)


def verdict(code: int, outcomes: list[RankOutcome], rank_offset: int = 0) -> Verdict:
    """The `Verdict` of a launch that exited with `code` (the launcher's, non-zero), from its
    ranks' `diagnose`d outcomes (keyed by local index; `rank_offset` makes job ranks)."""
    job = job_code(code, outcomes)
    if not outcomes:
        return Verdict(job, "unknown", None, f"the launcher exited with code {code}")
    first = outcomes[0]
    return Verdict(job, CAUSES[first.kind], first.rank + rank_offset, first.text, first.kind)


def job_code(launcher_code: int, outcomes: list[RankOutcome]) -> int:
    """The failed job's exit code: the code of the rank to blame when it exited with its own
    (`EXIT_CONFIG`, `EXIT_CHECKPOINT`, ...), else the launcher's.

    The launcher reports the first rank it saw go down; when ranks leave with the same error
    at almost the same moment it may have stopped one mid-exit and report that signal instead.
    """
    if launcher_code != 0 and outcomes:
        first = outcomes[0]
        if first.kind == "error" and first.code:
            return first.code
    return launcher_code


def _tail(text: str, lines: int) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-lines:]


def failure_report(
    code: int,
    logs: Mapping[int, str | None],
    launcher_output: str,
    log_dir: Path,
    rank_offset: int = 0,
) -> str:
    """The text printed after a failed job: the rank to blame, the others, its last lines.

    `logs` are keyed by this node's local process index (`workerlog.<i>`, as the launcher
    reports them); the report names job ranks, `rank_offset` + i (node R of a multi-node job:
    R × processes per node)."""
    outcomes = diagnose(logs, launcher_output)
    if not outcomes:
        return f"flashcp: the job failed (exit {code})"
    first = outcomes[0]
    head = first.rank + rank_offset
    lines = [f"flashcp: the job failed (exit {code}): rank {head} {first.text}"]
    for other in outcomes[1:]:
        same = _RANK_TAG.sub("", other.text) == _RANK_TAG.sub("", first.text)
        lines.append(
            f"flashcp:   rank {other.rank + rank_offset} " + ("the same" if same else other.text)
        )
    log = logs.get(first.rank)
    if log and (first.rank != 0 or first.kind == "killed"):  # local rank 0's log was streamed
        lines.append(f"flashcp: last lines of rank {head}'s log "
                     f"({worker_log(log_dir, first.rank)}):")  # fmt: skip
        lines += [f"    {line}" for line in _tail(log, TAIL_LINES)]
    return "\n".join(lines)


def launcher_killed_text(signum: int) -> str:
    """What happened when Paddle's launcher itself was killed by `signum`."""
    return (f"Paddle's launcher was killed by {_signal_name(-signum)} from outside (the "
            "out-of-memory killer, a kill, a scheduler), and its ranks ended with it")  # fmt: skip


def launcher_killed(code: int, signum: int) -> str:
    """The failure line when Paddle's launcher was killed (no rank is to blame)."""
    return f"flashcp: the job failed (exit {code}): {launcher_killed_text(signum)}"


def ending_line(
    how: str,
    code: int,
    *,
    saved: tuple[int, Path, int] | None,
    newest: tuple[int, Path, int] | None,
    interrupted: bool = False,
    training: bool = True,
) -> str:
    """`flashcp train`'s last line: how the job ended, the step it saved (`saved`: the newest
    complete checkpoint, when this command wrote it; else none, and `newest` the one a resume
    would start from), and its exit code; an `interrupted` job that can resume says so."""
    parts = [f"flashcp: {how}"]
    if training:
        if saved is not None:
            parts.append(f"saved step {saved[0]} ({saved[1]})")
        elif newest is not None:
            parts.append(f"no step saved (the newest checkpoint is step {newest[0]}, {newest[1]})")
        else:
            parts.append("no step saved")
        if interrupted and code != 0:
            since = "from it" if newest is not None else "from the start"
            parts[-1] += f"; run the same command again to resume {since}"
    parts.append(f"exit {code}")
    return "; ".join(parts)


def log_sizes(log_dir: Path, nproc: int) -> dict[int, int]:
    """Current sizes of the rank logs: the launcher appends, so a run's part starts there."""
    sizes = {}
    for rank in range(nproc):
        path = worker_log(log_dir, rank)
        sizes[rank] = path.stat().st_size if path.is_file() else 0
    return sizes


def read_rank_logs(log_dir: Path, offsets: Mapping[int, int]) -> dict[int, str | None]:
    """Each rank's log written since `offsets` (None when the rank wrote none)."""
    logs: dict[int, str | None] = {}
    for rank, offset in offsets.items():
        path = worker_log(log_dir, rank)
        if not path.is_file():
            logs[rank] = None
            continue
        with open(path, "rb") as f:
            f.seek(offset)
            logs[rank] = f.read().decode("utf-8", "replace")
    return logs
