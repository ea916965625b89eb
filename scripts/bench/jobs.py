"""Run shipped configs through `flashcp train` and judge the result: golden losses, log hygiene.

Shared by `scripts/update_golden.py`, `scripts/stress_launch.py` and the tests (`test_jobs.py`,
`test_faults.py`, `test_stress_quick.py`, ...), so "a clean job" and "the golden losses" mean
one thing:

* `run_flashcp(config, overrides)` runs `python -m flashcp train` (launcher and workers marked
  with `FLASHCP_LAUNCH_ID`, so nothing outlives the timeout) and returns a `JobRun`; the test
  harness marks the jobs it launches the same way (`launch_env`).
* `hygiene_problems(run)` lists why a finished job is not clean: exit code, a rank without its
  `exit 0` line (written after process-group teardown), abort/assertion/crash text in any
  log, a process left behind.
* Golden losses (`tests/golden/losses.json`) are keyed by config path (relative to the repo):
  `{"nproc", "steps", "overrides", "losses": {"1": ..., "2": ..., "4": ...}, "basis": {"1":
  [n, scale], ...}}`, read from each run's `metrics.jsonl`; `compare_losses` checks them with
  the float32 rule of `bench.numerics`: step s may differ by `tolerance(n, scale, steps=s)`,
  n and scale being the reduction length and magnitude behind the golden loss
  (`numerics.metric_basis`: the target tokens and the loss; for DPO the answer tokens per pair
  and β·|log π|). The goldens were written on one machine; another CPU's kernels sum in
  another order (`docs/portability.md`), which is what the rule allows for.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import numerics
from flashcp.config import load_config
from flashcp.launch import supervise
from flashcp.launch.outcome import EXIT_LINE_RE
from flashcp.metrics.writer import read_metrics

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
GOLDEN_FILE = ROOT / "tests/golden/losses.json"
"""The goldens `scripts/update_golden.py` writes and the tests check (data, not code)."""
GOLDEN_STEPS = 4
"""Every golden job runs this many optimizer steps..."""
CHECK_STEPS = (1, 2, 4)
"""...and its losses at these steps are compared."""
TOLERANCE_RULE = (
    "tests/numerics.py: |loss - golden| <= FACTOR * eps32 * sqrt(n) * scale * step, "
    "(n, scale) per step in `basis`"
)
"""What the golden file's `tolerance` field says (the rule lives in `bench.numerics`; the text
keeps the rule's old path so `tests/golden/losses.json` stays byte-identical)."""
JOB_TIMEOUT = 180.0
UPDATE_HINT = "run `python scripts/update_golden.py --write` and commit tests/golden/losses.json"
MARKER_ENV = "FLASHCP_LAUNCH_ID"
"""Marks every process of a job started here or by the test harness (apart from the
`FLASHCP_JOB_ID` a `flashcp train` gives its own job), so the whole job can be found and killed."""
INHERITED = ("PADDLE_", "MASTER_")
"""Environment prefixes such a job never inherits (wider than the library's default)."""

BAD_LOG = re.compile(
    r"Traceback|Assertion|assert(ion)? failed|Abort|core dumped|Segmentation fault|FatalError|"
    r"terminate called|uv__|Error Message Summary|SIGSEGV|SIGABRT|SIGBUS|SIGTERM|SIGKILL",
)
"""Text that must never appear in a clean job's logs (upstream's GLM-4.5 DPO-LoRA-PP job died
at shutdown with a libuv `uv__finish_close` assertion)."""


def discover_configs(root: Path = ROOT) -> list[str]:
    """Every shipped tiny config, `configs/**/tiny_*.yaml`, as repo-relative paths."""
    return sorted(str(p.relative_to(root)) for p in (root / "configs").rglob("tiny_*.yaml"))


def world_size(config: str | Path) -> int:
    """The number of processes `flashcp train` launches for `config`."""
    return int(load_config(ROOT / config).parallel.world_size)


def golden_overrides(steps: int = GOLDEN_STEPS) -> list[str]:
    """Overrides of a golden job (besides `run.output_dir`): short, deterministic, fresh."""
    return [
        f"train.steps={steps}",
        "train.deterministic=true",
        "checkpoint.every=0",
        "checkpoint.resume=never",
    ]


@dataclass
class JobRun:
    """One finished `flashcp train` job."""

    config: str
    nproc: int
    returncode: int
    output: str
    """What `flashcp train` printed (stdout and stderr)."""
    out_dir: Path
    duration: float
    timed_out: bool = False
    leftover: list[int] = field(default_factory=list)
    """Job processes still alive a few seconds after `flashcp train` exited (then killed)."""
    log_offsets: dict[int, int] = field(default_factory=dict)
    """Sizes of the rank logs before this job: the launcher appends to a reused output dir."""

    @property
    def log_dir(self) -> Path:
        return self.out_dir / "logs"

    def log(self, rank: int) -> str:
        """What `rank` wrote to its log during this job."""
        path = self.log_dir / f"workerlog.{rank}"
        if not path.is_file():
            return ""
        with open(path, "rb") as f:
            f.seek(self.log_offsets.get(rank, 0))
            return f.read().decode("utf-8", "replace")

    def launcher_log(self) -> str:
        path = self.log_dir / "launcher.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def losses(self) -> dict[int, float]:
        """Loss per step from `metrics.jsonl` (not grepped from a log)."""
        return {int(r["step"]): float(r["loss"]) for r in read_metrics(self.out_dir)}

    def summary(self, tail: int = 30) -> str:
        """Output and each rank's log tail, for assertion messages."""
        parts = [
            f"{self.config}: returncode={self.returncode} timed_out={self.timed_out} "
            f"duration={self.duration:.1f}s leftover={self.leftover}",
            "--- flashcp train ---",
            *self.output.splitlines()[-tail:],
        ]
        for rank in range(self.nproc):
            parts += [f"--- rank {rank} ---", *self.log(rank).splitlines()[-tail:]]
        return "\n".join(parts)


def launch_env(marker: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment minus any surrounding job's identity (`INHERITED`), every process
    marked `MARKER_ENV=marker`, one thread per process (N processes do not oversubscribe the
    cores), plus `extra`."""
    return supervise.job_env(marker, marker_env=MARKER_ENV, drop=INHERITED,
                             extra={"OMP_NUM_THREADS": "1", **(extra or {})})  # fmt: skip


def job_env(marker: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """`launch_env` without an inherited `FLASHCP_FAULT`, plus `extra`."""
    env = launch_env(marker)
    env.pop("FLASHCP_FAULT", None)
    env.update(extra or {})
    return env


def start_job(
    cmd: Sequence[str], marker: str, env: Mapping[str, str] | None = None
) -> supervise.Job:
    """Start `cmd` in the repo root (its own session), its output piped, everything it starts
    marked `FLASHCP_LAUNCH_ID=marker`, `env` over the job environment (`job_env`)."""
    return supervise.Job.start(
        list(cmd),
        job_env(marker, env),
        marker_env=MARKER_ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )


def flashcp_job(
    config: str | Path, overrides: Sequence[str], marker: str, env: Mapping[str, str] | None = None
) -> supervise.Job:
    """Start `python -m flashcp train CONFIG OVERRIDES` as a test job (`start_job`)."""
    return start_job([sys.executable, "-m", "flashcp", "train", str(config), *overrides],
                     marker, env)  # fmt: skip


def start_flashcp(
    config: str | Path, overrides: Sequence[str], marker: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """`flashcp_job`'s process, for tests that drive it themselves."""
    return flashcp_job(config, overrides, marker, env).proc


def leftover_after(marker: str, settle: float = 10.0) -> list[int]:
    """Job processes still alive `settle` s after the job ended (they are then killed)."""
    return supervise.leftover(marker, settle, marker_env=MARKER_ENV)


def run_flashcp(
    config: str | Path,
    overrides: Sequence[str],
    out_dir: Path,
    *,
    nproc: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = JOB_TIMEOUT,
) -> JobRun:
    """Run a `flashcp train` job writing to `out_dir`; never outlives `timeout` s."""
    marker = uuid.uuid4().hex
    nproc = world_size(config) if nproc is None else nproc
    logs = Path(out_dir) / "logs"
    offsets = {
        r: (logs / f"workerlog.{r}").stat().st_size
        for r in range(nproc)
        if (logs / f"workerlog.{r}").is_file()
    }
    start = time.monotonic()
    job = flashcp_job(config, [*overrides, f"run.output_dir={out_dir}"], marker, env)
    returncode, timed_out, output = job.wait(timeout)
    duration = time.monotonic() - start
    return JobRun(
        config=str(config),
        nproc=nproc,
        returncode=returncode,
        output=output or "",
        out_dir=Path(out_dir),
        duration=duration,
        timed_out=timed_out,
        leftover=leftover_after(marker),
        log_offsets=offsets,
    )


def rank_exit_codes(log: str) -> list[int]:
    """The exit codes a rank's log reports (`[flashcp] rank R exit C`), in order."""
    return [int(code) for _, code in EXIT_LINE_RE.findall(log)]


def hygiene_problems(run: JobRun, *, expect_code: int = 0) -> list[str]:
    """Why `run` is not a clean job (empty when it is)."""
    found = []
    if run.timed_out:
        found.append(f"timed out after {run.duration:.0f} s")
    elif run.returncode != expect_code:
        found.append(f"exit code {run.returncode} (expected {expect_code})")
    if run.leftover:
        found.append(f"processes left behind: {run.leftover}")
    for rank in range(run.nproc):
        log = run.log(rank)
        codes = rank_exit_codes(log)
        if codes != [expect_code]:
            found.append(
                f"rank {rank} reported exit codes {codes} (expected [{expect_code}] after a "
                "clean process-group teardown)"
            )
        if m := BAD_LOG.search(log):
            found.append(f"rank {rank} log contains {m.group(0)!r}")
    if m := BAD_LOG.search(run.launcher_log()):
        found.append(f"launcher log contains {m.group(0)!r}")
    return found


# -- golden losses ----------------------------------------------------------------------------


def load_golden(path: Path = GOLDEN_FILE) -> dict[str, Any]:
    """The golden file (`{"jobs": {}}` when absent)."""
    if not path.is_file():
        return {"tolerance": TOLERANCE_RULE, "jobs": {}}
    return json.loads(path.read_text())


def dpo_beta(config: str | Path) -> float | None:
    """The config's DPO β (None for the LM recipes): it sets the scale of a DPO loss."""
    dpo = load_config(ROOT / config).extras.get("dpo")
    return None if dpo is None else float(dpo.beta)


def golden_entry(run: JobRun, steps: int = GOLDEN_STEPS) -> dict[str, Any]:
    """The golden record of a finished job at the check steps: losses and gradient norms, each
    with the rule's basis. The gradient norm is the stronger check (a label shift moves it by
    ~10x what it moves the loss, in the rule's units; `tests/unit/bench/test_numerics.py`)."""
    rows = {int(r["step"]): r for r in read_metrics(run.out_dir)}
    beta = dpo_beta(run.config)
    checked = [s for s in CHECK_STEPS if s in rows]
    return {
        "nproc": run.nproc,
        "steps": steps,
        "overrides": golden_overrides(steps),
        "losses": {str(s): float(rows[s]["loss"]) for s in checked},
        "basis": {str(s): list(numerics.metric_basis(rows[s], "loss", beta=beta)) for s in checked},
        "grad_norms": {str(s): float(rows[s]["grad_norm"]) for s in checked},
        "grad_basis": {str(s): list(numerics.metric_basis(rows[s], "grad_norm")) for s in checked},
    }


def compare_loss(entry: Mapping[str, Any], step: str, value: float) -> numerics.Comparison:
    """`value` against the golden loss of `step` under the rule (basis from the golden)."""
    n, scale = entry["basis"][step]
    return numerics.compare(
        value, float(entry["losses"][step]), n=n, scale=scale, steps=int(step),
        what=f"loss step {step}",
    )  # fmt: skip


def compare_grad_norm(entry: Mapping[str, Any], step: str, value: float) -> numerics.Comparison:
    """`value` against the golden gradient norm of `step` under the rule."""
    n, scale = entry["grad_basis"][step]
    return numerics.compare(
        value, float(entry["grad_norms"][step]), n=n, scale=scale, steps=int(step),
        what=f"grad_norm step {step}",
    )  # fmt: skip


def close(entry: Mapping[str, Any], step: str, value: float) -> bool:
    """Whether `value` is within the rule of the golden loss of `step`."""
    return compare_loss(entry, step, value).ok


def compare_losses(
    config: str,
    want: Mapping[str, Any] | None,
    got: Mapping[str, Any],
    tol: float | None = None,
) -> list[str]:
    """Differences between a golden entry and a new one (empty when they agree).

    Float32 runs are judged by the rule of `bench.numerics` with the golden's basis. `tol`
    is for a run in ANOTHER dtype (a bfloat16 GPU job against the float32 goldens), which that
    rule does not model: |loss - golden| <= tol · max(1, |golden|)."""
    if want is None:
        return [f"{config}: no golden losses: {UPDATE_HINT}"]
    problems = []
    for key in ("nproc", "steps", "overrides"):
        if want.get(key) != got.get(key):
            problems.append(
                f"{config}: golden {key} {want.get(key)!r} != {got.get(key)!r}: {UPDATE_HINT}"
            )
    old, new = want.get("losses", {}), got.get("losses", {})
    if tol is None and set(old) - set(want.get("basis", {})):
        return [*problems, f"{config}: golden entry has no tolerance basis: {UPDATE_HINT}"]
    for step in sorted(set(old) | set(new), key=int):
        if step not in old or step not in new:
            problems.append(f"{config}: step {step} only in {'new' if step in new else 'golden'}")
            continue
        a, b = float(new[step]), float(old[step])
        if tol is not None:
            if abs(a - b) > tol * max(1.0, abs(b)):
                problems.append(
                    f"{config}: step {step} loss {a!r} != golden {b!r} "
                    f"(diff {a - b:+.3e}, cross-dtype tolerance {tol:g})"
                )
            continue
        result = compare_loss(want, step, a)
        if not result.ok:
            problems.append(
                f"{config}: step {step} loss {a!r} != golden {b!r} "
                f"(diff {a - b:+.3e}; {result.describe()})"
            )
        norms = got.get("grad_norms", {})
        if tol is None and step in want.get("grad_norms", {}):
            if step not in norms:
                problems.append(f"{config}: step {step} has no gradient norm to compare")
                continue
            g, h = float(norms[step]), float(want["grad_norms"][step])
            result = compare_grad_norm(want, step, g)
            if not result.ok:
                problems.append(
                    f"{config}: step {step} grad_norm {g!r} != golden {h!r} "
                    f"(diff {g - h:+.3e}; {result.describe()})"
                )
    return problems
