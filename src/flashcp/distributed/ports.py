"""Ports for rendezvous servers that nothing else on the machine can take meanwhile.

A rendezvous port is chosen by one process and bound later by another: Paddle's launcher picks
`PADDLE_MASTER` and the trainer endpoints (random ports in 35100-64000 that were free when it
looked), and rank 0 binds its TCPStore there seconds later, after importing Paddle. Two things
can take such a port in that window, and Paddle's libuv TCPStore aborts the process (SIGABRT in
`~LibUVMasterDaemon`) when its bind fails, so the job dies before any flashcp code can react:

* any `bind(("", 0))` or outgoing connection on the machine: the launcher's range overlaps the
  kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 here), which
  gloo's pair listeners and every group store draw from (seen in CI: rank 1 reached *another*
  job's server on the master port, then rank 0's bind failed);
* another job's launcher that picked the same free-looking port.

`reserve(n)` returns a `PortLease` of `n` consecutive ports outside the ephemeral range (so no
kernel-chosen port can ever land on them), each free when probed the way Paddle's launcher
probes and each held by an exclusive `flock` on `<tmp>/flashcp-ports/<port>` until the lease is
released (so no other flashcp job, test or CI run on this machine picks it; a dead holder's
locks vanish with it). `PortLease.env()` gives `PORT_RANGE`, the variable Paddle's launcher
draws all its ports from. The lock files stay (empty, at most one per port of the window):
deleting a held one would let a second process lock a new file for the same port.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default, assumed when the file cannot be read."""
PORT_FLOOR = 20000
"""Lowest port handed out: below it sit many well-known service ports."""
MIN_WINDOW = 256
LOCK_DIR_NAME = "flashcp-ports"
ATTEMPTS = 200


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range `(low, high)`, inclusive."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return (low, high) if 0 < low <= high <= 65535 else DEFAULT_EPHEMERAL


def rendezvous_window(ephemeral: tuple[int, int] | None = None) -> tuple[int, int]:
    """The widest run of ports in `[PORT_FLOOR, 65535]` outside the ephemeral range.

    Raises `RuntimeError` (saying how to widen it) when none is at least `MIN_WINDOW` wide."""
    low, high = ephemeral or ephemeral_range()
    candidates = [(PORT_FLOOR, min(low - 1, 65535)), (max(high + 1, PORT_FLOOR), 65535)]
    first, last = max(candidates, key=lambda r: r[1] - r[0])
    if last - first + 1 < MIN_WINDOW:
        raise RuntimeError(
            f"the ephemeral port range {low}-{high} ({EPHEMERAL_RANGE_FILE}) leaves fewer than "
            f"{MIN_WINDOW} ports in {PORT_FLOOR}-65535 for rendezvous servers: narrow it (e.g. "
            "`sysctl net.ipv4.ip_local_port_range='32768 60999'`) or set FLASHCP_MASTER_PORT"
        )
    return first, last


def lock_dir() -> Path:
    """`<tmp>/flashcp-ports`, shared by every user's flashcp processes on this machine."""
    path = Path(tempfile.gettempdir()) / LOCK_DIR_NAME
    path.mkdir(exist_ok=True)
    with contextlib.suppress(OSError):  # another user's directory: leave its mode alone
        path.chmod(0o1777)
    return path


def probe(port: int) -> bool:
    """Whether `port` can be bound now, checked like Paddle's launcher does (no SO_REUSEADDR,
    so a port still in TIME_WAIT counts as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _lock(directory: Path, port: int) -> int | None:
    """An fd holding an exclusive flock on `directory/<port>`, or None if someone holds it."""
    try:
        fd = os.open(directory / str(port), os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return None  # another user's lock file: treat the port as theirs
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


@dataclass
class PortLease:
    """`count` consecutive ports from `first`, held until `release()` (or process exit)."""

    first: int
    count: int
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def ports(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def env(self) -> dict[str, str]:
        """`PORT_RANGE` for Paddle's launcher: every port it picks comes from this lease."""
        return {"PORT_RANGE": f"{self.first}:{self.last}"}

    def release(self) -> None:
        """Drop the locks (the ports may be handed out again)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> PortLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def reserve(
    count: int = 1,
    *,
    window: tuple[int, int] | None = None,
    directory: Path | None = None,
    rng: random.Random | None = None,
) -> PortLease:
    """Lease `count` consecutive free ports outside the ephemeral range (see the module doc).

    Raises `RuntimeError` after `ATTEMPTS` random starts without a free run."""
    if count < 1:
        raise ValueError(f"reserve(count={count}): count must be at least 1")
    first, last = window or rendezvous_window()
    if last - first + 1 < count:
        raise ValueError(f"reserve(count={count}): the window {first}-{last} is too small")
    directory = directory or lock_dir()
    rng = rng or random.SystemRandom()
    for _ in range(ATTEMPTS):
        start = rng.randint(first, last - count + 1)
        lease = PortLease(start, count)
        for port in lease.ports:
            fd = _lock(directory, port)
            if fd is None:
                break
            lease._fds.append(fd)
            if not probe(port):
                break
        else:
            return lease
        lease.release()
    raise RuntimeError(
        f"no {count} consecutive free ports in {first}-{last} after {ATTEMPTS} tries (held "
        f"under {directory} or bound by other processes): free some, or set "
        "FLASHCP_MASTER_PORT / PORT_RANGE yourself"
    )
