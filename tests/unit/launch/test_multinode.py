"""`flashcp train --nnodes N --node-rank R --master HOST:PORT`: the pieces that need no job.

The launcher command of one node, its log directory, the master checks of node 0 (the port is
free for its launcher) and of the other nodes (wait for node 0, with a timeout), the
rendezvous watch, job ranks in a failure report, the degree check naming the node count, and
`flashcp validate --nnodes`. The jobs themselves run in
`tests/integration/test_multinode.py`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashcp import cli, runlock
from flashcp.config import load_config
from flashcp.distributed import launch_env
from flashcp.launch import job, launcher, outcome, preflight, supervise
from flashcp.launch.preflight import Nodes, PreflightError
from flashcp.problems import ProblemsError
from helpers.paths import ROOT

CP2 = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        yield int(sock.getsockname()[1])


def test_launch_command_of_one_node(tmp_path: Path) -> None:
    nodes = Nodes(count=2, rank=1, master="10.0.0.1:29500")
    cmd = job.launch_command("c.yaml", ["train.steps=2"], 4, tmp_path, None, nodes)
    i = cmd.index("paddle.distributed.launch")
    assert cmd[i + 1 :] == [
        "--nproc_per_node", "4", "--log_dir", str(tmp_path),
        "--nnodes", "2", "--rank", "1", "--master", "10.0.0.1:29500",
        str(launcher.train_script()), "--config", "c.yaml", "train.steps=2",
    ]  # fmt: skip
    one = job.launch_command("c.yaml", [], 2, tmp_path, 4000, Nodes(master="127.0.0.1:29511"))
    assert "--nnodes" not in one and one[one.index("--master") + 1] == "127.0.0.1:29511"
    assert nodes.log_dir("out") == Path("out/logs/node1")
    assert Nodes().log_dir("out") == Path("out/logs") and not Nodes().multi


@pytest.mark.parametrize(
    "master", ["node0", "h:", ":29500", "h:port", "h:70000", "fd00::2:29500", None]
)
def test_master_must_be_host_and_port(master: str | None) -> None:
    with pytest.raises(PreflightError, match=r"^--master: .* is not HOST:PORT \(a port 1-65535;"
                       ) as refused:  # fmt: skip
        Nodes(count=2, master=master).endpoint()
    assert [p.key for p in refused.value.problems] == ["--master"]
    assert Nodes(count=2, master="node-0.cluster:29500").endpoint() == ("node-0.cluster", 29500)


def test_node0_needs_the_master_port_free(listening: int) -> None:
    busy = Nodes(count=2, rank=0, master=f"127.0.0.1:{listening}")
    with pytest.raises(PreflightError, match=rf"^--master: binding 127\.0\.0\.1:{listening} is "
                       r"already in use .*: pick a free port \(the same on every "
                       r"node\)"):  # fmt: skip
        preflight.check_master(busy)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    preflight.check_master(Nodes(count=2, rank=0, master=f"127.0.0.1:{free}"))
    not_here = Nodes(count=2, rank=0, master="192.0.2.123:29500")
    preflight.check_master(not_here)  # not on this machine: not bound


def test_other_nodes_wait_for_node0(listening: int) -> None:
    started = time.monotonic()
    preflight.check_master(Nodes(count=2, rank=1, master=f"127.0.0.1:{listening}"), timeout=5)
    assert time.monotonic() - started < 2
    # node 0's launcher comes up a little later: the wait covers it
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = socket.socket()

    def serve() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen(1)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        preflight.check_master(Nodes(count=2, rank=1, master=f"127.0.0.1:{port}"), timeout=10)
    finally:
        thread.join()
        server.close()
    with pytest.raises(PreflightError, match=r"node 1: node 0's launcher .* did not accept "
                       r"connections within 0\.2 s"):  # fmt: skip
        preflight.check_master(Nodes(count=2, rank=1, master=f"127.0.0.1:{port}"), timeout=0.2)


def test_rendezvous_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not launcher.workers_started("no-such-job")
    # the launcher has the training script among its arguments, a worker runs it
    marker = uuid.uuid4().hex
    env = {**os.environ, supervise.JOB_MARKER: marker}
    sleep = "import time; time.sleep(30)"
    script = str(launcher.train_script())
    fake = subprocess.Popen(
        [sys.executable, "-c", sleep, "paddle.distributed.launch", script], env=env
    )
    try:
        deadline = time.monotonic() + 10
        while not supervise.marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervise.marked_pids(marker) == [fake.pid]
        assert not launcher.workers_started(marker)
        worker = subprocess.Popen([sys.executable, "-c", sleep, script], env=env)
        try:
            assert launcher.workers_started(marker)
        finally:
            worker.kill()
            worker.wait()
    finally:
        fake.kill()
        fake.wait()
    monkeypatch.setenv("FLASHCP_INIT_TIMEOUT", "7")
    assert launcher.rendezvous_timeout() == 7.0
    text = launcher.rendezvous_lost(Nodes(count=3, rank=0, master="h:1"))
    assert "node 0: the 3 nodes did not all join at --master h:1 within 7 s" in text
    assert "--node-rank R --master h:1` on every node R = 0..2" in text


def test_failure_report_names_job_ranks(tmp_path: Path) -> None:
    logs = {
        0: "fine\n[flashcp] rank 2 exit 0\n",
        1: "boom\nValueError: bad\n[flashcp] rank 3 exit 1\n",
    }
    text = outcome.failure_report(1, logs, "", tmp_path, rank_offset=2)
    assert "rank 3 exited with code 1: ValueError: bad" in text
    assert "rank 2 finished" in text and f"({tmp_path / 'workerlog.1'})" in text


def test_degrees_against_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    load_config(CP2, nnodes=2)  # 2 processes over 2 nodes: one each
    with pytest.raises(ProblemsError, match=r"= 2 processes cannot be split over "
                       r"--nnodes 3 nodes"):  # fmt: skip
        load_config(CP2, nnodes=3)
    load_config(CP2, world_size=2, nnodes=2)
    with pytest.raises(ProblemsError, match=r"the job has 6 processes \(3 nodes × 2 per "
                       r"node\): set parallel\.cp=6 data\.seq_len=252, or set parallel\.dp=3, "
                       r"or launch with a node count that divides 2"):  # fmt: skip
        load_config(CP2, world_size=6, nnodes=3)
    monkeypatch.setenv("PADDLE_NNODES", "2")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    assert launch_env().nnodes == 2 and launch_env().world_size == 4


def test_cli_node_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", str(CP2), "--nnodes", "0"]) == 2
    assert "--nnodes must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["validate", str(CP2), "--nnodes", "2"]) == 0
    assert cli.main(["validate", str(CP2), "--nnodes", "4"]) == 2  # 2: a refused config
    assert "cannot be split over --nnodes 4 nodes" in capsys.readouterr().out


def test_only_node0_moves_the_earlier_run_aside(tmp_path: Path, listening: int) -> None:
    """`run.overwrite: true` over two nodes sharing `run.output_dir`: node 0 moves the earlier
    run aside before its launcher serves `--master`; node 1, which starts once it does, leaves
    the directory alone — node 0's new logs in it stay where they are, nothing is moved twice."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "checkpoints" / "step_2" / "model.safetensors").write_bytes(b"earlier")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    cfg = load_config(CP2, [f"run.output_dir={out}", "run.overwrite=true"], nnodes=2)
    environ = {"PORT_RANGE": "40000:40100"}  # no port lease: none is needed to prepare
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    said: list[str] = []
    node0 = preflight.preflight(cfg, Nodes(count=2, rank=0, master=f"127.0.0.1:{free}"),
                                environ=environ, say=said.append, checked=True)  # fmt: skip
    assert node0.log_dir == out / "logs" / "node0" and node0.log_dir.is_dir()
    (aside,) = tmp_path.glob("run.old-*")
    assert (aside / "metrics.jsonl").is_file() and (aside / "checkpoints" / "step_2").is_dir()
    assert said == [f"flashcp: run.overwrite: moved the earlier run in {out} to {aside}"]
    (node0.log_dir / "workerlog.0").write_text("step 1/4\n")  # node 0's job has started
    with socket.socket() as served:  # node 0's launcher serves --master; node 1 starts
        served.bind(("127.0.0.1", free))
        served.listen()
        node1 = preflight.preflight(cfg, Nodes(count=2, rank=1, master=f"127.0.0.1:{free}"),
                                    environ=environ, say=said.append, checked=True)  # fmt: skip
    assert node1.log_dir == out / "logs" / "node1" and node1.log_dir.is_dir()
    assert (out / "logs" / "node0" / "workerlog.0").read_text() == "step 1/4\n"
    assert list(tmp_path.glob("run.old-*")) == [aside] and len(said) == 1


def test_the_other_nodes_check_that_node_0_of_their_job_holds_the_lock(tmp_path: Path) -> None:
    """The lock is the job's: node 0 takes it naming `--master` and the node count; node 1
    goes on under it, and is refused when another job holds it or none does."""
    master = "127.0.0.1:29517"
    node1 = Nodes(count=2, rank=1, master=master)
    with pytest.raises(PreflightError, match=r"^run\.output_dir: node 1: node 0's launcher serves "
                       r"--master 127\.0\.0\.1:29517 but holds no lock on .* shared by "
                       r"every node"):  # fmt: skip
        preflight.job_lock(tmp_path, node1)
    held = runlock.acquire(tmp_path, runlock.Holder("flashcp train", os.getpid(), master=master,
                                                    nnodes=2))  # fmt: skip
    try:
        assert preflight.job_lock(tmp_path, node1).token == held.token
        with pytest.raises(PreflightError, match=r"^run\.output_dir: node 1: .* is in use by "
                           r"flashcp train \(pid"):  # fmt: skip
            preflight.job_lock(tmp_path, Nodes(count=2, rank=1, master="127.0.0.1:29518"))
    finally:
        held.release()
