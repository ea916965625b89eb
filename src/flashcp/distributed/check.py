"""Debug mode that turns a diverged collective into a one-line error instead of a hang.

With `FLASHCP_CHECK_COLLECTIVES=1`, every flashcp collective (`flashcp.distributed.collectives`,
`all_to_all`, `gather_rows`, and the point-to-point `send_tensor` / `recv_tensor` on two-rank
groups) first exchanges a fingerprint with the other members of its group — the operation, the
shapes and dtypes it was handed, the group's call index on this rank and the call site (three
frames outside `flashcp.distributed`) — and compares them. When any rank differs (another
operation, another shape, or a rank that skipped a call, which shows as another call index),
every member raises `CollectiveMismatchError` naming each rank's call and where it was made::

    collective mismatch on cp[0,1] at call #75: rank 0 all_reduce float64[19] at grads.py:91
    all_reduce_values < step_sums.py:41 all_reduce < trainer.py:263 _step_sums | rank 1
    all_gather(axis=1) float32[1,64,2,16] at allgather_kv.py:57 gather_kv < ...

The fingerprints travel by `all_gather_object` on the same group, so ranks that diverged into
two different collectives of ONE group meet in the check and report; ranks waiting on two
different groups still meet the watchdog (the timeout message then names this rank's own call).
It costs one small object exchange per collective: a debugging and testing mode, off by default.

Point-to-point transfers on groups of more than two ranks (NCCL pipelines with pp > 2) are not
fingerprinted: a third member would never join the exchange. Compound operations (a ring
reduce-scatter, the gloo all-to-all) are fingerprinted once, on their group, not per transfer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paddle.distributed as dist

from flashcp.distributed.watchdog import WATCHDOG, resolve_timeout

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

ENV_CHECK = "FLASHCP_CHECK_COLLECTIVES"
_PACKAGE_DIR = str(Path(__file__).resolve().parent)


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called different collectives (check mode)."""


def enabled() -> bool:
    """Whether check mode is on (`FLASHCP_CHECK_COLLECTIVES` set to 1/true/yes/on)."""
    return os.environ.get(ENV_CHECK, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to do on a group."""

    rank: int
    op: str
    """The operation as the group must agree on it (`send`/`recv` pair up as `p2p`)."""
    shapes: tuple[str, ...]
    index: int
    site: str
    shown: str
    """The operation as this rank names it (`send(to rank 1)`)."""

    def key(self) -> tuple[Any, ...]:
        return (self.op, self.shapes, self.index)

    def describe(self) -> str:
        shapes = " ".join(self.shapes)
        return f"rank {self.rank} {self.shown}{' ' + shapes if shapes else ''} at {self.site}"


_calls: dict[str, int] = {}
"""Per group label: the collectives this process has checked on it."""


def tensor_text(x: Any) -> str:
    """`float32[2,64]`: a tensor's dtype and shape as fingerprints show them."""
    dtype = str(getattr(x, "dtype", "?")).replace("paddle.", "")
    return f"{dtype}[{','.join(str(int(d)) for d in x.shape)}]"


def call_site(depth: int = 3) -> str:
    """`file:line function` of the first `depth` frames outside `flashcp.distributed`, innermost
    first (`grads.py:91 all_reduce_values < step_sums.py:41 all_reduce < trainer.py:263 ...`)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts) or "?"


def agree(
    op: str,
    group: Group,
    label: str,
    tensors: Sequence[Any] = (),
    *,
    shapes: Sequence[str] | None = None,
    shown: str | None = None,
    timeout: float | None = None,
) -> None:
    """In check mode, make every member of `group` (named `label` in messages) agree on this
    call before it is made.

    `op` is what all members must call; `tensors` (or the preformatted `shapes`) what they must
    agree on; `shown` how this rank names the call (default `op`). Raises
    `CollectiveMismatchError` on every member when they differ. No-op when the mode is off or
    the group has one rank.
    """
    if not enabled() or int(group.nranks) == 1:
        return
    index = _calls.get(label, 0) + 1
    _calls[label] = index
    mine = Fingerprint(
        rank=int(dist.get_rank()),
        op=op,
        shapes=tuple(shapes if shapes is not None else (tensor_text(t) for t in tensors)),
        index=index,
        site=call_site(),
        shown=shown or op,
    )
    seconds = resolve_timeout(timeout)
    message = (
        f"[flashcp] collective check on group {label} timed out after {seconds:g} s on rank "
        f"{mine.rank}: this rank waits at call #{index}: {mine.describe()}; a peer is dead, "
        "hung, or in a collective of another group"
    )
    everyone: list[Fingerprint] = []
    with WATCHDOG.watch(seconds, message):
        dist.all_gather_object(everyone, mine, group=group)
    if len({f.key() for f in everyone}) > 1:
        raise CollectiveMismatchError(mismatch_text(label, everyone))


def mismatch_text(label: str, fingerprints: Sequence[Fingerprint]) -> str:
    """One line: the group, the call index of the first rank, and every rank's call."""
    first = min(f.index for f in fingerprints)
    calls = " | ".join(f.describe() + (f" (call #{f.index})" if f.index != first else "")
                       for f in fingerprints)  # fmt: skip
    return f"collective mismatch on {label} at call #{first}: {calls}"


def reset() -> None:
    """Forget the call indices (a new set of groups, or a test)."""
    _calls.clear()
