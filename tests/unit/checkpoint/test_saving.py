"""The save protocol (`flashcp.checkpoint.saving`) in one process: ranks are threads that meet
in a gather (what `all_gather_object` does across processes), so the agreement, the commit and
the failure paths run exactly as in a job; files are real, faults injected (`flashcp.faults`).

The trainer-level paths (async checkpoints resumed bitwise, a failed save survived by `fit`)
are `test_async_training.py`; a launched job with a kill during an async write and a failed
save is `tests/integration/test_faults.py`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashcp import faults
from flashcp.checkpoint import format as ck
from flashcp.checkpoint import saving
from flashcp.checkpoint.parts import tmp_dir
from flashcp.checkpoint.saving import (
    FAILED,
    SAVED,
    STALL,
    WAIT,
    Commit,
    PartFile,
    PartReport,
    SaveError,
    SaveReport,
    Saves,
    Snapshot,
)

TIMEOUT = 60.0


class Meeting:
    """`n` ranks (threads) gathering objects: each call returns every rank's object, in rank
    order, once all have called (a barrier on both sides, so rounds cannot mix)."""

    def __init__(self, n: int) -> None:
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=TIMEOUT)

    def gather(self, rank: int) -> Callable[[Any], list[Any]]:
        def gather(obj: Any) -> list[Any]:
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


class Rank:
    """One rank's `Saves` and what it printed (rank 0: `echo`) or logged (`warn`)."""

    def __init__(self, root: Path, rank: int, meeting: Meeting, **kwargs: Any) -> None:
        self.lines: list[str] = []
        options = {"asynchronous": True, "fail_on_error": False, **kwargs}
        self.saves = Saves(root, rank=rank, gather=meeting.gather(rank), timeout=TIMEOUT,
                           echo=self.lines.append, warn=self.lines.append,
                           **options)  # fmt: skip


def _ranks(root: Path, n: int = 2, **kwargs: Any) -> list[Rank]:
    meeting = Meeting(n)
    return [Rank(root, r, meeting, **kwargs) for r in range(n)]


def _on_all(ranks: list[Rank], call: Callable[[Rank], Any]) -> list[Any]:
    """`call(rank)` on every rank at once (threads); results in rank order, or the exception
    a rank raised in its place."""
    out: list[Any] = [None] * len(ranks)

    def run(i: int) -> None:
        try:
            out[i] = call(ranks[i])
        except Exception as exc:  # returned to the test, which asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a rank hung"
    return out


def _weights(step: int, rank: int) -> dict[str, np.ndarray]:
    return {f"w{rank}": np.arange(6, dtype=np.float32).reshape(2, 3) * step + rank}


def _snapshot(step: int, rank: int, n: int = 2, keep_last: int | None = 2) -> Snapshot:
    """Rank `rank`'s part of a checkpoint in parts: one model part per rank; rank 0 commits."""
    names = [f"model-{r + 1:05d}-of-{n:05d}.safetensors" for r in range(n)]
    files = [PartFile(names[rank], _weights(step, rank), {"format": "1"})]
    commit = None
    if rank == 0:
        layout = {"model": names, "optimizer": []}
        commit = Commit({"scheduler": {}, "consumed_tokens": 10 * step}, layout, names, keep_last)
    return Snapshot(step, files, commit)


def _save(step: int, **kwargs: Any) -> Callable[[Rank], SaveReport]:
    return lambda r: r.saves.save(step, lambda: _snapshot(step, r.saves.rank, **kwargs))


def _saved(step: int, **kwargs: Any) -> Callable[[Rank], SaveReport]:
    """Save `step` and wait for it to settle (sync or async)."""
    save = _save(step, **kwargs)
    return lambda r: save(r).merge(r.saves.finish())


def _steps(root: Path) -> list[int]:
    return [s for s, _ in ck.list_checkpoints(root)]


def _loaded_weights(path: Path) -> dict[str, np.ndarray]:
    return ck.load_checkpoint(path).model


class Gate:
    """Holds the writes of files whose name contains `hold` until `open()` (a slow disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: str) -> None:
        self.event = threading.Event()
        self.entered = threading.Event()
        real = saving.save_file

        def save_file(arrays: Any, filename: str, metadata: Any = None) -> None:
            if hold in filename:
                self.entered.set()
                assert self.event.wait(TIMEOUT)
            real(arrays, filename, metadata=metadata)

        monkeypatch.setattr(saving, "save_file", save_file)

    def open(self) -> None:
        self.event.set()


def test_async_checkpoint_appears_only_when_every_rank_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, hold="model-00002")  # rank 1's part is slow
    ranks = _ranks(tmp_path)
    reports = _on_all(ranks, _save(2))
    assert all(isinstance(r, SaveReport) for r in reports), reports
    assert gate.entered.wait(TIMEOUT)
    for _ in range(3):  # step boundaries while rank 1 still writes: nothing is committed
        assert _on_all(ranks, lambda r: r.saves.poll().saved) == [[], []]
        assert _steps(tmp_path) == [] and ck.latest_checkpoint(tmp_path) is None
    assert (tmp_dir(tmp_path, 2) / "model-00001-of-00002.safetensors").is_file()
    gate.open()
    deadline = time.monotonic() + TIMEOUT
    settled: list[Any] = [SaveReport(), SaveReport()]
    while settled[0].saved == [] and time.monotonic() < deadline:
        settled = _on_all(ranks, lambda r: r.saves.poll())
    path = tmp_path / "step_2"
    assert [r.saved for r in settled] == [[path], []]  # rank 0 commits, at one boundary
    assert [r.metrics[SAVED] for r in settled] == [2.0, 2.0]
    assert settled[0].messages == [f"saved checkpoint {path}"]
    assert ck.verify_checkpoint(path) == [] and ck.latest_checkpoint(tmp_path) == path
    manifest = json.loads((path / ck.MANIFEST_FILE).read_text())
    assert manifest["layout"]["model"] == ["model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors"]  # fmt: skip
    got = _loaded_weights(path)
    for rank in (0, 1):
        np.testing.assert_array_equal(got[f"w{rank}"], _weights(2, rank)[f"w{rank}"])
    assert ck.load_checkpoint(path).state["consumed_tokens"] == 20
    assert ranks[0].lines == ranks[1].lines == []  # nothing to warn about
    assert all(r.saves.inflight is None for r in ranks)
    assert _on_all(ranks, lambda r: r.saves.poll().metrics) == [{}, {}]  # nothing in flight


def test_the_snapshot_is_the_checkpoint_whatever_training_does_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host copies are taken at the boundary: the writer (held back here until training
    changed the live arrays) writes what the step boundary saw."""
    live = {"w0": np.ones(4, np.float32)}
    changed = threading.Event()
    real = saving.write_part

    def held_back(*args: Any) -> PartReport:
        assert changed.wait(TIMEOUT)
        return real(*args)

    monkeypatch.setattr(saving, "write_part", held_back)

    def files() -> Iterator[PartFile]:
        yield PartFile("model.safetensors", {k: v.copy() for k, v in live.items()})
        yield PartFile("optimizer.safetensors", {"m": live["w0"] * 2})

    (rank,) = _ranks(tmp_path, n=1)
    commit = Commit({}, None, saving.CLASSIC_FILES, None)
    rank.saves.save(3, lambda: Snapshot(3, files(), commit))
    live["w0"] += 1  # the next optimizer step
    changed.set()
    assert rank.saves.finish().saved == [tmp_path / "step_3"]
    loaded = ck.load_checkpoint(tmp_path / "step_3")
    np.testing.assert_array_equal(loaded.model["w0"], np.ones(4))
    np.testing.assert_array_equal(loaded.optimizer["m"], np.full(4, 2.0))


def test_one_save_in_flight_the_next_waits_and_the_wait_is_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, hold="model-00001")
    (rank,) = _ranks(tmp_path, n=1)
    first = rank.saves.save(2, lambda: _snapshot(2, 0, n=1))
    assert first.metrics[WAIT] == 0.0 and first.metrics[STALL] > 0
    assert gate.entered.wait(TIMEOUT)
    threading.Timer(0.5, gate.open).start()
    second = rank.saves.save(4, lambda: _snapshot(4, 0, n=1))
    # the next save waited for the first, which committed before the next began
    assert second.metrics[WAIT] >= 0.4 and second.metrics[STALL] >= second.metrics[WAIT]
    assert second.metrics[SAVED] == 2.0 and second.saved == [tmp_path / "step_2"]
    assert rank.saves.inflight == 4
    done = rank.saves.finish()
    assert done.saved == [tmp_path / "step_4"] and done.metrics[WAIT] == done.metrics[STALL]
    assert _steps(tmp_path) == [2, 4]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_pruning_runs_in_the_background_and_never_overlaps_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """Deleting old checkpoints is off the training thread (a commit returns while it runs),
    and done before the next save begins (pruning removes stale `.tmp` directories: never the
    one being written)."""
    events: list[str] = []
    release = threading.Event()
    real_prune, real_begin = saving.prune_checkpoints, saving.begin

    def slow_prune(root: Path, keep_last: int) -> list[Path]:
        events.append("prune starts")
        assert release.wait(TIMEOUT)
        release.clear()
        removed = real_prune(root, keep_last)
        events.append("prune ends")
        return removed

    def begin(root: Path, step: int, **kwargs: Any) -> Path:
        events.append(f"begin {step}")
        return real_begin(root, step, **kwargs)

    monkeypatch.setattr(saving, "prune_checkpoints", slow_prune)
    monkeypatch.setattr(saving, "begin", begin)
    (rank,) = _ranks(tmp_path, n=1, asynchronous=asynchronous)
    for step in (2, 4):
        threading.Timer(0.2, release.set).start()  # the pruning ends only later
        report = rank.saves.save(step, lambda step=step: _snapshot(step, 0, n=1, keep_last=1))
        while rank.saves.inflight is not None:  # steps go by until it commits
            report = report.merge(rank.saves.poll())
        assert report.saved == [tmp_path / f"step_{step}"]
    rank.saves.finish()
    # every save began only after the pruning of the commit before it had ended
    assert events == ["begin 2", "prune starts", "prune ends", "begin 4", "prune starts",
                      "prune ends"]  # fmt: skip
    assert _steps(tmp_path) == [4]
    # a commit returns while its pruning still runs
    report = rank.saves.save(6, lambda: _snapshot(6, 0, n=1, keep_last=1))
    while rank.saves.inflight is not None:
        report = report.merge(rank.saves.poll())
    assert report.saved == [tmp_path / "step_6"] and events[-1] == "prune starts"
    release.set()
    rank.saves.finish()
    assert events[-1] == "prune ends" and _steps(tmp_path) == [6]


@pytest.mark.parametrize("asynchronous", [True, False])
@pytest.mark.parametrize("kind", ["save_enospc", "save_eacces", "save_eio"])
def test_a_failed_part_fails_the_save_on_every_rank_and_keeps_the_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, asynchronous: bool
) -> None:
    ranks = _ranks(tmp_path, asynchronous=asynchronous)
    for step in (2, 4):
        _on_all(ranks, _saved(step))
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_4").iterdir()}
    monkeypatch.setenv(faults.ENV_FAULT, f"{kind}@step6:rank1")
    reports = _on_all(ranks, _saved(6))
    code = kind.removeprefix("save_").upper()
    for rank, report in zip(ranks, reports, strict=True):
        assert report.failed == [6] and report.metrics[FAILED] == 6.0 and report.saved == []
        (line,) = rank.lines[-1:]
        assert f"checkpoint step 6 was not saved: rank 1: {code} (" in line, line
        assert str(tmp_dir(tmp_path, 6)) in line  # the cause names the path
        assert "newest checkpoint is still step_4 (nothing pruned)" in line
    assert ranks[1].lines[-1].startswith("[rank 1] warning:")
    # the latest good checkpoint and the keep_last rotation are untouched; no .tmp is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_4").iterdir()} == before
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_4"
    # the next save tries again, commits, and only then does the rotation move
    monkeypatch.delenv(faults.ENV_FAULT)
    assert _on_all(ranks, _saved(8))[0].saved == [tmp_path / "step_8"]
    assert _steps(tmp_path) == [4, 8]


def test_fail_on_error_raises_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = _ranks(tmp_path, fail_on_error=True)
    _on_all(ranks, _saved(2))
    monkeypatch.setenv(faults.ENV_FAULT, "save_enospc@step4:rank0")
    raised = _on_all(ranks, _saved(4))
    for exc in raised:
        assert isinstance(exc, SaveError) and isinstance(exc, ck.CheckpointError), exc
        assert "checkpoint step 4 was not saved: rank 0: ENOSPC" in str(exc)
        assert "the newest checkpoint is step_2" in str(exc)
    assert _steps(tmp_path) == [2] and not tmp_dir(tmp_path, 4).exists()


def test_a_failed_commit_fails_the_save_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's own commit (the manifest, the rename) failing: every rank learns it."""

    def full(*_args: Any, **_kwargs: Any) -> Path:
        raise OSError(28, "No space left on device", str(tmp_path / "step_2.tmp/manifest.json"))

    monkeypatch.setattr(saving, "publish", full)
    ranks = _ranks(tmp_path, asynchronous=False)
    reports = _on_all(ranks, _save(2))
    assert [r.failed for r in reports] == [[2], [2]]
    assert "rank 0 (commit): ENOSPC (No space left on device)" in ranks[1].lines[-1]
    assert _steps(tmp_path) == [] and not tmp_dir(tmp_path, 2).exists()


def test_a_failed_begin_skips_the_snapshot_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(root: Path, step: int, **_kwargs: Any) -> Path:
        raise PermissionError(13, "Permission denied", str(root))

    monkeypatch.setattr(saving, "begin", denied)
    ranks = _ranks(tmp_path)
    taken: list[int] = []

    def save(r: Rank) -> SaveReport:
        return r.saves.save(2, lambda: taken.append(r.saves.rank) or _snapshot(2, r.saves.rank))

    reports = _on_all(ranks, save)
    assert [r.failed for r in reports] == [[2], [2]] and taken == []
    assert "rank 0: EACCES (Permission denied)" in ranks[0].lines[-1]
    assert all(r.saves.inflight is None for r in ranks)


def test_a_bug_in_a_writer_raises_on_every_rank(tmp_path: Path) -> None:
    """Anything but an OSError is not a failed save to train past: every rank raises."""

    def bad(rank: int) -> Snapshot:
        snap = _snapshot(2, rank)
        if rank == 1:
            snap.files = [PartFile("x.safetensors", {"a": "not an array"})]  # type: ignore[dict-item]
        return snap

    ranks = _ranks(tmp_path)
    _on_all(ranks, lambda r: r.saves.save(2, lambda: bad(r.saves.rank)))
    raised = _on_all(ranks, lambda r: r.saves.finish())
    assert all(isinstance(e, SaveError) and "rank 1:" in str(e) for e in raised), raised
    assert "fail_on_error" not in str(raised[0])


def test_a_part_nobody_wrote_is_never_committed(tmp_path: Path) -> None:
    def lost(rank: int) -> Snapshot:
        snap = _snapshot(2, rank)
        if rank == 1:
            snap.files = []
        return snap

    ranks = _ranks(tmp_path, asynchronous=False)
    raised = _on_all(ranks, lambda r: r.saves.save(2, lambda: lost(r.saves.rank)))
    assert all(isinstance(e, SaveError) for e in raised), raised
    assert "no rank wrote model-00002-of-00002.safetensors" in str(raised[0])
    assert _steps(tmp_path) == []


def test_a_sync_save_drains_its_files_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Producing a file may be a collective (experts): a rank whose write failed still
    produces the rest, so its peers are not left waiting."""
    produced: list[str] = []

    def files() -> Iterator[PartFile]:
        for name in ("a.safetensors", "b.safetensors"):
            produced.append(name)
            yield PartFile(name, {"x": np.zeros(2, np.float32)})

    monkeypatch.setenv(faults.ENV_FAULT, "save_eio@step2")
    report = saving.write_part(tmp_path, Snapshot(2, files()), 0)
    assert report.error is not None and report.error.startswith("EIO (Input/output error)")
    assert produced == ["a.safetensors", "b.safetensors"] and report.files == {}


def test_a_crash_during_an_async_write_leaves_the_previous_checkpoint_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Killed(BaseException):
        """The process dying in the writer thread (SIGKILL, here only the thread ends)."""

    def kill() -> None:
        raise Killed

    monkeypatch.setattr(faults, "_kill_self", kill)
    monkeypatch.setattr(threading, "excepthook", lambda _args: None)
    (rank,) = _ranks(tmp_path, n=1)
    rank.saves.save(2, lambda: _snapshot(2, 0, n=1))
    rank.saves.finish()
    monkeypatch.setenv(faults.ENV_FAULT, "crash_in_checkpoint_write@step4")
    rank.saves.save(4, lambda: _snapshot(4, 0, n=1))
    assert rank.saves.writer._thread is not None
    rank.saves.writer._thread.join(TIMEOUT)  # the "process" is gone: nothing settles
    assert (tmp_dir(tmp_path, 4) / "model-00001-of-00001.safetensors").is_file()
    assert not (tmp_dir(tmp_path, 4) / ck.MANIFEST_FILE).exists()
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_2"  # resume takes the previous
    # a new process (resumed from step 2) saves step 4 again: the torn directory is replaced
    monkeypatch.delenv(faults.ENV_FAULT)
    (again,) = _ranks(tmp_path, n=1)
    again.saves.save(4, lambda: _snapshot(4, 0, n=1))
    assert again.saves.finish().saved == [tmp_path / "step_4"]
    assert ck.verify_checkpoint(tmp_path / "step_4") == [] and _steps(tmp_path) == [2, 4]


def test_writer_timeout_fails_the_save_and_the_writer_refuses_a_second_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, hold="model-00001")
    writer = saving.Writer()
    writer.start(tmp_path, _snapshot(2, 0, n=1).copied(), 0)
    assert gate.entered.wait(TIMEOUT)
    late = writer.wait(0.05, 0)
    assert late.error == "the write did not finish within 0.05 s" and not late.fatal
    with pytest.raises(RuntimeError, match="still running"):
        writer.start(tmp_path, _snapshot(2, 0, n=1).copied(), 0)
    gate.open()
    assert writer.wait(TIMEOUT, 0).error is None and writer.done


def test_describe_names_the_errno_and_the_path() -> None:
    assert saving.describe(OSError(28, "No space left on device", "/x/y")) == (
        "ENOSPC (No space left on device): /x/y"
    )
    assert saving.describe(OSError(5, "Input/output error")) == "EIO (Input/output error)"
    assert saving.describe(ValueError("bad")) == "ValueError: bad"


def test_reports_merge_stalls_and_keep_events() -> None:
    a = SaveReport({STALL: 1.0, SAVED: 2.0}, ["a"], [Path("2")])
    b = SaveReport({STALL: 0.5, WAIT: 0.5, SAVED: 4.0}, ["b"], [Path("4")], [6])
    merged = a.merge(b)
    assert merged.metrics == {STALL: 1.5, WAIT: 0.5, SAVED: 4.0}
    assert merged.messages == ["a", "b"] and merged.saved == [Path("2"), Path("4")]
    assert merged.failed == [6]
    assert PartReport(0).error is None


class _DiskEvents:
    """The order of a commit's writes, fsyncs and renames, by file name (`os.fsync` and
    `os.rename` recorded, then done; `Path.write_text` recorded)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import os

        self.events: list[tuple[str, str]] = []
        fsync, rename, write_text = os.fsync, os.rename, Path.write_text

        def on_fsync(fd: int) -> None:
            self.events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
            fsync(fd)

        def on_rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            self.events.append(("rename", Path(src).name))
            rename(src, dst, *a, **k)

        def on_write_text(path: Path, *a: Any, **k: Any) -> int:
            self.events.append(("write", path.name))
            return write_text(path, *a, **k)

        monkeypatch.setattr(os, "fsync", on_fsync)
        monkeypatch.setattr(os, "rename", on_rename)
        monkeypatch.setattr(Path, "write_text", on_write_text)

    def at(self, event: tuple[str, str]) -> int:
        assert event in self.events, (event, self.events)
        return self.events.index(event)


def _commit_saves(root: Path, step: int) -> Path:
    """`saving.commit`, what `Saves` runs on rank 0: one part written, then the commit."""
    tmp = tmp_dir(root, step)
    tmp.mkdir(parents=True)
    for name in saving.CLASSIC_FILES:
        (tmp / name).write_bytes(b"tensors")
    report = PartReport(0, files={n: ck.file_entry(tmp / n) for n in saving.CLASSIC_FILES})
    spec = Commit(state={"data": {"row": 3}}, layout=None, expected=saving.CLASSIC_FILES,
                  keep_last=None)  # fmt: skip
    return saving.commit(root, step, spec, [report])


def test_the_trainer_state_is_on_disk_before_the_manifest_and_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Durability after a crash: a checkpoint directory that has its manifest, or its final
    name, has its trainer_state.json on disk — fsynced after it was written and before the
    manifest is written and the directory renamed (else a power cut could leave step_N/
    with a manifest over an empty or stale trainer state)."""
    disk = _DiskEvents(monkeypatch)
    final = _commit_saves(tmp_path, 3)
    assert final == tmp_path / "step_3" and ck.verify_checkpoint(final) == []
    synced = disk.at(("fsync", ck.STATE_FILE))
    assert disk.at(("write", ck.STATE_FILE)) < synced
    assert synced < disk.at(("write", ck.MANIFEST_FILE)) < disk.at(("rename", "step_3.tmp"))
