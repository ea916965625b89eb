"""More than one node, on localhost: two launchers meeting at a `--master`.

* `flashcp train CONFIG --nnodes 2 --node-rank {0,1} --master 127.0.0.1:PORT`: the 4-rank
  `configs/gpt/tiny_cp4.yaml` job as two 2-process "nodes" trains BITWISE like the same job on
  one 4-process node: the same global ranks (node R holds ranks 2R, 2R+1), the same groups and
  the same reduction order; only where the processes were started differs.
* The same through `python -m paddle.distributed.launch --nnodes 2 --rank R --master ...`
  directly (2 nodes × 1 process of `configs/gpt/tiny_cp2.yaml`): the golden losses.
* A node whose peers never come is stopped after `FLASHCP_INIT_TIMEOUT`, with the commands
  to run, and leaves no process behind.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.jobs import (
    BAD_LOG,
    ROOT,
    JobRun,
    compare_losses,
    golden_entry,
    golden_overrides,
    job_env,
    leftover_after,
    load_golden,
    rank_exit_codes,
    run_flashcp,
    start_flashcp,
)
from flashcp.distributed import ports
from flashcp.launch import supervise
from flashcp.metrics.writer import read_metrics
from helpers.launch import MARKER_ENV

pytestmark = pytest.mark.integration

CP4 = "configs/gpt/tiny_cp4.yaml"
CP2 = "configs/gpt/tiny_cp2.yaml"
STEPS = 3
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every=0", "checkpoint.resume=never"]
TIMEOUT = 240.0


@pytest.fixture
def master() -> Iterator[str]:
    """`127.0.0.1:PORT` on a leased port (`flashcp.distributed.ports`), held for the test."""
    with ports.reserve(1) as lease:
        yield f"127.0.0.1:{lease.first}"


def wait_all(
    procs: list[subprocess.Popen[str]], markers: list[str], timeout: float = TIMEOUT
) -> list[str]:
    """Outputs of `procs`; on timeout everything of the job is killed and the test fails."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc, marker in zip(procs, markers, strict=True):
            supervise.stop(marker, proc, marker_env=MARKER_ENV, grace=supervise.KILL_GRACE)
        texts = "\n".join(p.communicate()[0] for p in procs)
        pytest.fail(f"a node did not finish in time:\n{texts}")
    return outputs


def node_problems(out: Path, node: int, ranks: range) -> list[str]:
    """Why node `node`'s part of a job in `out` is not clean (its ranks' logs)."""
    found = []
    logs = out / "logs" / f"node{node}"
    for local, rank in enumerate(ranks):
        log = (logs / f"workerlog.{local}").read_text(errors="replace")
        if rank_exit_codes(log) != [0]:
            found.append(f"rank {rank} reported {rank_exit_codes(log)}")
        if f"[flashcp] rank {rank} exit 0" not in log:
            found.append(f"node {node} log {local} is not rank {rank}'s")
        if m := BAD_LOG.search(log):
            found.append(f"rank {rank} log contains {m.group(0)!r}")
    return found


def metrics(out: Path) -> list[tuple[int, float, float, int]]:
    return [(r["step"], r["loss"], r["grad_norm"], r["targets"]) for r in read_metrics(out)]


@pytest.mark.timeout(420)
def test_two_nodes_train_bitwise_like_one_node(tmp_path: Path, master: str) -> None:
    one = run_flashcp(CP4, OVERRIDES, tmp_path / "one")
    assert one.returncode == 0, one.summary()
    out = tmp_path / "two"
    markers = [uuid.uuid4().hex for _ in range(2)]
    procs = []
    for node, marker in enumerate(markers):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master", master,
                *OVERRIDES, f"run.output_dir={out}"]  # fmt: skip
        procs.append(start_flashcp(CP4, args, marker))
        time.sleep(0.5)
    outputs = wait_all(procs, markers)
    for node, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, text
        assert f"launching 2 process(es) as node {node} of 2 (ranks {2 * node}-{2 * node + 1} " \
               f"of 4, rendezvous {master})" in text  # fmt: skip
        assert "HTTP Request" not in text and "LAUNCH INFO" not in text
    assert f"step {STEPS}/{STEPS}" in outputs[0]  # node 0 streams rank 0
    assert node_problems(out, 0, range(0, 2)) == [] and node_problems(out, 1, range(2, 4)) == []
    assert [leftover_after(m) for m in markers] == [[], []]
    assert metrics(out) == metrics(tmp_path / "one")  # bitwise


@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_launcher_direct_two_nodes_match_the_golden_losses(tmp_path: Path, master: str) -> None:
    out = tmp_path / "run"
    overrides = [*golden_overrides(), f"run.output_dir={out}"]
    markers = [uuid.uuid4().hex for _ in range(2)]
    procs = []
    leases = [ports.reserve(3) for _ in markers]  # each launcher's own ports (PORT_RANGE)
    for node, marker in enumerate(markers):
        cmd = [
            sys.executable, "-m", "paddle.distributed.launch",
            "--nnodes", "2", "--rank", str(node), "--master", master,
            "--nproc_per_node", "1", "--log_dir", str(out / "logs" / f"node{node}"),
            str(ROOT / "src" / "flashcp" / "train.py"), "--config", CP2, *overrides,
        ]  # fmt: skip
        procs.append(subprocess.Popen(
            cmd, cwd=ROOT, env={**job_env(marker), **leases[node].env()}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        ))  # fmt: skip
        time.sleep(0.5)
    outputs = wait_all(procs, markers)
    for lease in leases:
        lease.release()
    for proc, text in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, text[-3000:]
    assert node_problems(out, 0, range(0, 1)) == [] and node_problems(out, 1, range(1, 2)) == []
    run = JobRun(config=CP2, nproc=2, returncode=0, output="", out_dir=out, duration=0.0)
    want = load_golden()["jobs"].get(CP2)
    assert compare_losses(CP2, want, golden_entry(run)) == []


@pytest.mark.timeout(180)
def test_a_node_alone_is_stopped_after_the_rendezvous_timeout(tmp_path: Path, master: str) -> None:
    marker = uuid.uuid4().hex
    args = ["--nnodes", "2", "--node-rank", "0", "--master", master, *OVERRIDES,
            f"run.output_dir={tmp_path / 'run'}"]  # fmt: skip
    started = time.monotonic()
    proc = start_flashcp(CP4, args, marker, {"FLASHCP_INIT_TIMEOUT": "5"})
    (text,) = wait_all([proc], [marker], timeout=90)
    assert proc.returncode == 2, text
    assert f"node 0: the 2 nodes did not all join at --master {master} within 5 s" in text
    assert time.monotonic() - started < 60
    assert leftover_after(marker) == []
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
