"""Faults in real `flashcp train` jobs: a killed rank, a hang, pre-emption, a torn checkpoint,
NaN/Inf.

* A rank SIGKILLed mid-step: the job exits non-zero well within 60 s, names the dead rank, and
  leaves no process behind (checked through the launch marker).
* Automatic restarts (`run.max_restarts`): one job loses a rank to SIGKILL, then (relaunched)
  a rank hangs until the collective watchdog ends its peer; it is relaunched each time from
  the latest complete checkpoint and ends bitwise where an uninterrupted run ends (every
  loss, the final weights and optimizer state), with both restarts in `restarts.jsonl`.
* Pre-emption: SIGTERM to one rank, then SIGUSR1 to `flashcp train` itself: every rank
  finishes its step, saves, exits 75; the same command resumes, and the run ends bitwise as
  the uninterrupted one. A rank made slow meanwhile is named a straggler.
* A crash while rank 0 writes `step_N.tmp/`: the previous checkpoint stays intact and the
  automatic restart continues from it, reproducing the golden losses; a corrupted checkpoint is
  refused naming the file and its checksum (exit 4, never restarted), or skipped by `auto`.
* NaN in the loss: exit 3 naming the step and the rank (never restarted); with
  `train.on_nonfinite: skip` the job continues, says which steps it skipped, and
  `metrics.jsonl` marks them.
* Asynchronous checkpoints: a failed save (ENOSPC on one rank) is survived, a rank killed by
  its own background writer leaves the previous checkpoint the latest, and the resumed run
  ends bitwise equal to an uninterrupted one.

Faults are injected with `FLASHCP_FAULT` (`flashcp.faults`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from bench import jobs
from flashcp import rundir
from flashcp.checkpoint.format import MODEL_FILE, OPTIMIZER_FILE, verify_checkpoint
from flashcp.launch import outcome
from flashcp.launch.supervise import alive
from helpers.launch import kill_marked, marked_pids

pytestmark = pytest.mark.integration

GPT2 = "configs/gpt/tiny_cp2.yaml"
GPT4 = "configs/gpt/tiny_cp4.yaml"
DEAD_RANK_DEADLINE = 60.0


def _rank_pid(marker: str, rank: int) -> int | None:
    """The worker process of `rank` in the job marked `marker` (from its environment)."""
    for pid in marked_pids(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"PADDLE_TRAINER_ID={rank}".encode() in environ and b"train.py" in cmdline:
            return pid
    return None


@pytest.mark.timeout(180)
def test_sigkill_of_a_rank_mid_step_fails_fast_and_names_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    marker = uuid.uuid4().hex
    args = ["train.steps=5000", "checkpoint.every=0", "checkpoint.resume=never",
            f"run.output_dir={out}"]  # fmt: skip
    proc = jobs.start_flashcp(GPT2, args, marker)
    try:
        deadline = time.monotonic() + 90
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.1)
        pid = _rank_pid(marker, 1)
        assert proc.poll() is None and pid is not None, proc.communicate()[0]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        text, _ = proc.communicate(timeout=DEAD_RANK_DEADLINE)
        elapsed = time.monotonic() - killed
        assert proc.returncode != 0, text
        assert elapsed < DEAD_RANK_DEADLINE, elapsed
        assert "the job failed" in text and "rank 1 died without writing an error" in text, text
        assert "SIGKILL" in text, text
        # rank 0 goes down with it: its next collective fails, or the launcher stops it
        assert "rank 0 lost its connection to a peer" in text or "rank 0 was stopped" in text
        assert jobs.leftover_after(marker) == []
    finally:
        kill_marked(marker)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(180)
def test_sigkill_fault_in_a_four_process_job(tmp_path: Path) -> None:
    run = jobs.run_flashcp(
        GPT4,
        ["train.steps=4", "checkpoint.every=0", "checkpoint.resume=never"],
        tmp_path / "run",
        env={"FLASHCP_FAULT": "sigkill@step2:rank2"},
    )
    assert run.returncode != 0 and not run.timed_out, run.summary()
    assert run.duration < DEAD_RANK_DEADLINE + 30, run.summary()
    assert "rank 2 died without writing an error" in run.output, run.output
    assert "[flashcp fault] rank 2 step 2: sigkill" in run.output  # its last log lines
    assert run.leftover == []
    assert [r["step"] for r in _metrics(run.out_dir)] == [1]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- a long job: restarts and pre-emption, against one uninterrupted run ----------------------

STEPS = 12
LONG = [f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep_last=2"]
"""The long job: 12 steps, a checkpoint every 2."""
WATCHDOG_S = "12"
"""The collective timeout of the long job: a hung rank is found after this long."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`LONG` run once without a fault: what the interrupted run must end as, bitwise."""
    run = jobs.run_flashcp(GPT2, LONG, tmp_path_factory.mktemp("uninterrupted") / "run")
    assert jobs.hygiene_problems(run) == [], run.summary()
    return run.out_dir


def _same_run(out: Path, ref: Path) -> None:
    """`out` ended bitwise as `ref`: one record per step with the same loss and gradient norm,
    and the same final weights and optimizer state."""
    got, want = _metrics(out), _metrics(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        a = load_file(str(out / "checkpoints" / f"step_{STEPS}" / name))
        b = load_file(str(ref / "checkpoints" / f"step_{STEPS}" / name))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), name


PREEMPTION_LINE = re.compile(r"pre-emption requested on rank|\[flashcp fault\] .*: sigterm")


def _preempted_cleanly(run: jobs.JobRun) -> list[str]:
    """`jobs.hygiene_problems` of a launch that ended pre-empted (exit 75): its logs may name
    SIGTERM only in the pre-emption's own lines (the request, the injected signal)."""
    logs = [run.log(rank) for rank in range(run.nproc)] + [run.launcher_log()]
    named = [line for text in logs for line in text.splitlines() if "SIGTERM" in line]
    strays = [line for line in named if not PREEMPTION_LINE.search(line)]
    problems = jobs.hygiene_problems(run, expect_code=outcome.EXIT_PREEMPTED)
    return strays + [p for p in problems if not p.endswith("contains 'SIGTERM'")]


@pytest.mark.timeout(600)
def test_a_long_job_survives_a_kill_a_hang_and_two_preemptions(
    tmp_path: Path, uninterrupted: Path
) -> None:
    """One run, three `flashcp train` commands, as a scheduler would start them:

    1. rank 1 SIGKILLed at step 3 (restart from step_2); relaunched, rank 0 hangs at step 5 and
       rank 1's watchdog ends the launch (restart from step_4); relaunched, rank 1 gets SIGTERM
       at step 7: every rank saves step 7 and exits 75, with no restart;
    2. the same command, rank 1 slow (named a straggler), SIGUSR1 to `flashcp train` once step
       8 is recorded: passed on, saved, 75;
    3. the same command runs to the end: bitwise the uninterrupted run."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = [*LONG, "run.max_restarts=3", "run.restart_backoff_s=0.5", "run.straggler_window=2"]
    faults = "sigkill@step3:rank1,hang@step5:rank0:attempt1,sigterm@step7:rank1:attempt2"
    one = jobs.run_flashcp(GPT2, args, out, timeout=400,
                           env={"FLASHCP_FAULT": faults, "FLASHCP_COLLECTIVE_TIMEOUT": WATCHDOG_S})
    assert one.returncode == outcome.EXIT_PREEMPTED and not one.timed_out, one.summary()
    assert one.leftover == [], one.summary()
    records = rundir.restart_records(out)
    assert [(r["restart"], r["cause"], r["rank"], r["resume_step"], r["backoff_s"])
            for r in records] == [(1, "killed", 1, 2, 0.5), (2, "hang", 0, 4, 1.0)]  # fmt: skip
    for step in (2, 4):
        assert f"resumed from {ckpts / f'step_{step}'} at step {step}" in one.output
    assert "restart 2 of 3 (run.max_restarts) after hang of rank 0" in one.output
    assert "timed out after 12 s on rank 1: rank 0 may be dead, hung" in one.output
    assert one.output.count("flashcp: launching 2 process(es)") == 3  # a pre-emption: no 4th
    assert "pre-emption requested on rank(s) 1 (SIGTERM): saving step 7" in one.output
    assert ("flashcp: pre-empted: every rank saved and stopped (a rank was signalled); saved "
            f"step 7 ({ckpts / 'step_7'}); run the same command again to resume from it; "
            "exit 75") in one.output.splitlines()[-1]  # the console's last line (issue 37)
    assert [r["step"] for r in _metrics(out)] == list(range(1, 8))
    assert verify_checkpoint(ckpts / "step_7") == []
    assert [jobs.rank_exit_codes(one.log(r))[-1] for r in range(2)] == [75, 75]

    marker = uuid.uuid4().hex
    env = {"FLASHCP_FAULT": "slow@step1:rank1", "FLASHCP_FAULT_SLOW_S": "0.4"}
    offsets = outcome.log_sizes(out / "logs", 2)
    proc = jobs.start_flashcp(GPT2, [*args, f"run.output_dir={out}"], marker, env)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if any(r["step"] >= 8 for r in _metrics(out)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGUSR1)
        text, _ = proc.communicate(timeout=120)  # run.preempt_grace_s is 120 s
        two = jobs.JobRun(GPT2, 2, proc.returncode, text, out, 0.0,
                          leftover=jobs.leftover_after(marker), log_offsets=offsets)
        assert _preempted_cleanly(two) == [], two.summary()
    finally:
        kill_marked(marker)
    assert "pre-emption (SIGUSR1): passed on to 2 rank(s)" in text
    assert "(SIGUSR1): saving step" in text and f"resumed from {ckpts / 'step_7'}" in text
    assert "straggler: rank 1 computed" in text
    slow = [r for r in _metrics(out) if r["step"] > 7 and "straggler/rank" in r]
    assert slow and all(r["straggler/rank"] == 1 and r["straggler/ratio"] > 1.2 for r in slow)
    stopped_at = _metrics(out)[-1]["step"]
    assert 8 <= stopped_at < STEPS
    assert verify_checkpoint(ckpts / f"step_{stopped_at}") == []

    three = jobs.run_flashcp(GPT2, args, out)
    assert jobs.hygiene_problems(three) == [], three.summary()
    assert f"resumed from {ckpts / f'step_{stopped_at}'}" in three.output
    assert len(rundir.restart_records(out)) == 2
    _same_run(out, uninterrupted)
    ledger = json.loads((out / "goodput.json").read_text())
    assert ledger["complete"] and ledger["restarts"] == 2 and ledger["step"] == STEPS
    assert ledger["restart_s"] > float(WATCHDOG_S)  # the hang's wait is time lost to it
    assert _metrics(out)[-1]["restarts"] == 2


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(240)
def test_crash_during_checkpoint_write_then_resume_and_corruption(tmp_path: Path) -> None:
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    args = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=2"]

    # 1. rank 0 dies inside step_4.tmp/ (step_4 never appears, step_2 stays intact); the
    #    automatic restart resumes from step_2, never from the torn write, and the run ends on
    #    the golden losses
    crashed = jobs.run_flashcp(
        GPT2, [*args, "run.max_restarts=1", "run.restart_backoff_s=0"], out,
        env={"FLASHCP_FAULT": "crash_in_checkpoint_write@step4"},
    )  # fmt: skip
    assert crashed.returncode == 0 and not crashed.timed_out, crashed.summary()
    assert "rank 0 died without writing an error" in crashed.output, crashed.output
    assert crashed.leftover == []
    (record,) = rundir.restart_records(out)
    assert (record["cause"], record["rank"], record["resume_step"]) == ("killed", 0, 2)
    assert f"resumed from {ckpts / 'step_2'} at step 2" in crashed.output
    assert "skipping broken checkpoint" not in crashed.output
    golden = jobs.load_golden()["jobs"][GPT2]
    losses = crashed.losses()
    for step in golden["losses"]:
        result = jobs.compare_loss(golden, step, losses[int(step)])
        assert result.ok, result.describe()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4"]  # .tmp cleaned
    assert verify_checkpoint(ckpts / "step_4") == []

    # 3. a corrupted file (same size, one byte flipped) is refused, naming file and checksum,
    #    and never restarted
    _flip_byte(ckpts / "step_4" / "optimizer.safetensors")
    refused = jobs.run_flashcp(
        GPT2, [*args, f"checkpoint.resume={ckpts / 'step_4'}", "run.max_restarts=2"], out
    )
    assert refused.returncode == 4, refused.summary()
    assert "is broken and was not loaded" in refused.output
    assert "optimizer.safetensors does not match its sha256 checksum" in refused.output
    assert "not restarting: a broken checkpoint (exit 4)" in refused.output
    assert refused.leftover == [] and len(rundir.restart_records(out)) == 1

    # 4. resume: auto skips it with a warning and continues from the intact step_2
    fallback = jobs.run_flashcp(GPT2, ["train.steps=6", *args[1:]], out)
    assert jobs.hygiene_problems(fallback) == [], fallback.summary()
    assert "skipping broken checkpoint" in fallback.output
    assert "optimizer.safetensors does not match its sha256 checksum" in fallback.output
    assert f"resumed from {ckpts / 'step_2'} at step 2" in fallback.output


def _contents(step_dir: Path) -> dict[str, object]:
    """Every file a checkpoint's manifest lists: a safetensors file as its metadata and each
    tensor's bytes (safetensors writes metadata keys in hash order, so equal files may differ
    in their header bytes), any other file as its text."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    out: dict[str, object] = {}
    for name in manifest["files"]:
        if name.endswith(".safetensors"):
            with safe_open(str(step_dir / name), "np") as f:
                tensors = {k: f.get_tensor(k).tobytes() for k in f.keys()}  # noqa: SIM118
                out[name] = (f.metadata(), tensors)
        else:
            out[name] = (step_dir / name).read_text()
    return out


@pytest.mark.timeout(300)
def test_async_saves_survive_a_failed_save_and_a_kill_mid_write_then_resume_bitwise(
    tmp_path: Path,
) -> None:
    """`checkpoint.async` with every rank writing a part (ZeRO-1: one optimizer shard each):
    rank 1's part of step 2 fails (ENOSPC) and the job trains on; step 4 commits; rank 0 is
    killed by its own background writer in the middle of step 6. The same command resumes from
    step 4 (never the torn step 6) and ends bitwise equal to an uninterrupted synchronous run:
    the same tensors, bit for bit, the same trainer state (data position, RNG, schedule), and
    the same losses."""
    args = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=3",
            "parallel.shard_optimizer=true"]  # fmt: skip
    reference = jobs.run_flashcp(GPT2, args, tmp_path / "sync")
    assert jobs.hygiene_problems(reference) == [], reference.summary()
    out = tmp_path / "async"
    ckpts = out / "checkpoints"
    faulty = jobs.run_flashcp(GPT2, [*args, "checkpoint.async=true"], out, env={
        "FLASHCP_FAULT": "save_enospc@step2:rank1,crash_in_checkpoint_write@step6:rank0",
    })  # fmt: skip
    assert faulty.returncode != 0 and not faulty.timed_out, faulty.summary()
    assert "rank 0 died without writing an error" in faulty.output, faulty.output
    assert faulty.leftover == []
    for rank in (0, 1):  # every rank logged the failed save with its cause, and trained on
        assert re.search(r"warning: checkpoint step 2 was not saved: rank 1: ENOSPC \(No space "
                         r"left on device\): \S+step_2\.tmp", faulty.log(rank)), faulty.log(rank)
    # the failure settles at a later step boundary (the writers run in the background)
    assert [r["checkpoint/failed_step"] for r in _metrics(out) if "checkpoint/failed_step" in r
            ] == [2]  # fmt: skip
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_6.tmp"]
    assert not (ckpts / "step_6.tmp" / "manifest.json").exists()
    assert verify_checkpoint(ckpts / "step_4") == []

    resumed = jobs.run_flashcp(GPT2, [*args, "checkpoint.async=true"], out)
    assert jobs.hygiene_problems(resumed) == [], resumed.summary()
    assert f"resumed from {ckpts / 'step_4'} at step 4" in resumed.output
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_6"]
    want = tmp_path / "sync" / "checkpoints"
    for step in (4, 6):
        assert _contents(ckpts / f"step_{step}") == _contents(want / f"step_{step}"), step
    key = ("step", "loss", "grad_norm")
    assert [[r[k] for k in key] for r in _metrics(out)] == [
        [r[k] for k in key] for r in _metrics(tmp_path / "sync")
    ]


@pytest.mark.timeout(180)
def test_nan_loss_stops_naming_step_and_rank(tmp_path: Path) -> None:
    run = jobs.run_flashcp(
        GPT2,
        ["train.steps=4", "checkpoint.every=0", "checkpoint.resume=never", "run.max_restarts=2"],
        tmp_path / "run",
        env={"FLASHCP_FAULT": "nan_loss@step3:rank1"},
    )
    # every rank stops at the same step with exit 3, through a clean teardown, and a relaunch
    # would not change that: no restart
    assert jobs.hygiene_problems(run, expect_code=3) == [], run.summary()
    assert "non-finite loss on rank(s) 1" in run.output and "at step 3" in run.output
    assert "flashcp: the job failed (exit 3)" in run.output
    assert "not restarting: a non-finite loss (exit 3) is not fixed by a relaunch" in run.output
    assert run.output.count("flashcp: launching") == 1
    assert rundir.restart_records(run.out_dir) == []
    assert [r["step"] for r in _metrics(run.out_dir)] == [1, 2]  # nothing trained on garbage


@pytest.mark.timeout(180)
def test_nonfinite_skip_continues_and_reports(tmp_path: Path) -> None:
    run = jobs.run_flashcp(
        GPT2,
        [
            "train.steps=4",
            "checkpoint.every=0",
            "checkpoint.resume=never",
            "train.on_nonfinite=skip",
        ],  # fmt: skip
        tmp_path / "run",
        env={"FLASHCP_FAULT": "inf_loss@step2:rank1,nan_grad@step3:rank0"},
    )
    assert jobs.hygiene_problems(run) == [], run.summary()
    assert "non-finite loss on rank(s) 1" in run.output
    assert "at step 2: update skipped" in run.output
    assert "non-finite gradients on rank(s) 0 at step 3: update skipped" in run.output
    records = _metrics(run.out_dir)
    assert [r["skipped"] for r in records] == [False, True, True, False]
    assert records[1]["loss"] in ("nan", "inf")
    assert isinstance(records[3]["loss"], float)
    # steps 2-3 changed nothing: step 1's update is the last one before step 4
    golden = jobs.load_golden()["jobs"][GPT2]
    result = jobs.compare_loss(golden, "1", records[0]["loss"])  # bench.numerics rule
    assert result.ok, result.describe()


def test_rank_pid_ignores_unknown_jobs() -> None:
    assert _rank_pid(uuid.uuid4().hex, 0) is None
    assert not any(alive(p) for p in marked_pids(uuid.uuid4().hex))
