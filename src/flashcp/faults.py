"""Fault injection for reliability tests, driven by the `FLASHCP_FAULT` environment variable.

Faults make the failure paths of a real launched job reproducible: a NaN at a chosen step on a
chosen rank, a rank killed in the middle of a step, a crash while a checkpoint is half written,
a save that fails (disk full, permission denied, an I/O error).
Nothing here runs unless `FLASHCP_FAULT` is set; a malformed value is an error (never ignored).

    FLASHCP_FAULT=nan_loss@step3:rank1                  # rank 1 outputs NaN at step 3
    FLASHCP_FAULT=nan_grad@step2:rank0,inf_loss@step4   # several faults, comma separated
    FLASHCP_FAULT=sigkill@step3:rank1                   # rank 1 SIGKILLs itself mid-step 3
    FLASHCP_FAULT=crash_in_checkpoint_write@step4       # the writing ranks die inside step_4.tmp/
    FLASHCP_FAULT=save_enospc@step4:rank1               # rank 1's part of checkpoint 4: ENOSPC
    FLASHCP_FAULT=sigkill@step3:rank1,hang@step5:rank0:attempt1   # then, relaunched, a hang

Each fault is `KIND@stepN[:rankR][:attemptA]` (no rank: every rank). A fault fires in one
launch attempt only (`flashcp.attempt`: 0, the first launch of a `flashcp train`, unless
`:attemptA` says otherwise), so a job that restarts after it does not meet it again. Kinds:

* `nan_loss` / `inf_loss`: the model's output (its final hidden states) is multiplied by NaN /
  +Inf on that step, so the rank's loss (and its gradients) are non-finite; the trainer must
  report or skip the step.
* `nan_grad`: the rank's gradient of its first trainable parameter becomes NaN (loss finite).
* `sigkill`: the rank sends itself SIGKILL right after its forward pass of that step, while its
  peers are inside the step's collectives.
* `crash_in_checkpoint_write`: a rank writing files of checkpoint `step_N` SIGKILLs itself
  after its first file is in `step_N.tmp/` (the one-writer layout: `model.safetensors`) and
  before the manifest: a torn write. With `checkpoint.async` the kill comes from the background
  writer, while training goes on.
* `save_enospc`, `save_eacces`, `save_eio`: the rank's part of checkpoint `step_N` fails with
  `OSError` ENOSPC (no space left on device), EACCES (permission denied) or EIO (an I/O error)
  before it writes a file (every rank has a part, if only an empty one): the failed-save path
  (`flashcp.checkpoint.saving`).
* `hang`: the rank stops answering right after its forward pass of that step (it sleeps,
  deaf to SIGTERM, until it is killed): its peers' collectives time out (the watchdog).
* `slow`: from step N on, the rank sleeps `FLASHCP_FAULT_SLOW_S` seconds (default 0.3) after
  each forward pass: a straggler (`flashcp.metrics.straggler`).
* `sigterm`: the rank sends itself SIGTERM right after its forward pass of that step: a
  pre-emption of one rank (`flashcp.launch.preempt`).

Wiring: `install(model, params, steps_done)` (called by `flashcp.launch.worker` with the built
trainer's model, trainable parameters and step count) adds the forward/gradient hooks; the
checkpoint writers call `on_checkpoint_write` (after each file) and `on_save_write` (before a
rank's part) at their fault points.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashcp.attempt import current as current_attempt

if TYPE_CHECKING:  # annotations only: the fault points import no Paddle
    import paddle

ENV_FAULT = "FLASHCP_FAULT"
KINDS: tuple[str, ...] = (
    "nan_loss",
    "inf_loss",
    "nan_grad",
    "sigkill",
    "crash_in_checkpoint_write",
    "save_enospc",
    "save_eacces",
    "save_eio",
    "hang",
    "slow",
    "sigterm",
)
SAVE_ERRORS: dict[str, int] = {
    "save_enospc": errno.ENOSPC,
    "save_eacces": errno.EACCES,
    "save_eio": errno.EIO,
}
"""The failed-save kinds and the errno each raises."""
FORWARD_KINDS = ("nan_loss", "inf_loss", "sigkill", "hang", "slow", "sigterm")
"""The kinds applied by the forward post-hook (`forward_hook`)."""
ENV_SLOW = "FLASHCP_FAULT_SLOW_S"
"""Seconds a `slow` rank sleeps after each forward pass (default `SLOW_SECONDS`)."""
SLOW_SECONDS = 0.3
_SPEC = re.compile(
    r"^(?P<kind>[a-z_]+)@step(?P<step>\d+)(?::rank(?P<rank>\d+))?(?::attempt(?P<attempt>\d+))?$"
)


class FaultSpecError(ValueError):
    """`FLASHCP_FAULT` does not parse; the message shows the expected form."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: what, at which optimizer step (1-based), on which rank (None: all),
    in which launch attempt (`flashcp.attempt`)."""

    kind: str
    step: int
    rank: int | None = None
    attempt: int = 0

    def hits(self, step: int, rank: int) -> bool:
        """Whether it fires at `step` on `rank` (of this process's attempt): at its step, or
        from it on for `slow`."""
        at = step >= self.step if self.kind == "slow" else step == self.step
        return at and (self.rank is None or self.rank == rank)


def parse_faults(text: str | None) -> list[Fault]:
    """The faults of a `FLASHCP_FAULT` value (empty or None: no faults)."""
    if text is None or not text.strip():
        return []
    faults = []
    for item in (part.strip() for part in text.split(",")):
        m = _SPEC.match(item)
        if m is None:
            raise FaultSpecError(
                f"{ENV_FAULT}: cannot parse {item!r}: expected KIND@stepN[:rankR][:attemptA] "
                f"(e.g. nan_loss@step3:rank1) with KIND one of {', '.join(KINDS)}"
            )
        kind = m.group("kind")
        if kind not in KINDS:
            raise FaultSpecError(
                f"{ENV_FAULT}: unknown fault kind {kind!r} in {item!r}: use one of "
                f"{', '.join(KINDS)}"
            )
        step = int(m.group("step"))
        if step < 1:
            raise FaultSpecError(f"{ENV_FAULT}: {item!r}: steps count from 1 (use @step1 or later)")
        rank, attempt = m.group("rank"), m.group("attempt")
        faults.append(Fault(kind, step, None if rank is None else int(rank),
                            int(attempt or 0)))  # fmt: skip
    return faults


def active_faults() -> list[Fault]:
    """The faults `FLASHCP_FAULT` asks for in this process's launch attempt."""
    index = current_attempt().index
    return [f for f in parse_faults(os.environ.get(ENV_FAULT)) if f.attempt == index]


def _rank() -> int:
    from flashcp.log import process_rank

    return process_rank()


def _announce(fault: Fault, rank: int, what: str) -> None:
    print(
        f"[flashcp fault] rank {rank} step {fault.step}: {fault.kind} ({what})",
        file=sys.stderr,
        flush=True,
    )


def _kill_self() -> None:
    """SIGKILL this process (no cleanup, no exit line): what a crash or OOM kill looks like."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _hang() -> None:
    """Stop answering: sleep (SIGTERM ignored) until killed, like a rank stuck in a kernel."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1.0)


def slow_seconds() -> float:
    """How long a `slow` rank sleeps per step (`FLASHCP_FAULT_SLOW_S`)."""
    raw = os.environ.get(ENV_SLOW, "").strip()
    try:
        return float(raw) if raw else SLOW_SECONDS
    except ValueError:
        raise FaultSpecError(f"{ENV_SLOW}={raw!r} is not a number of seconds") from None


def _poison(output: Any, factor: float) -> Any:
    """`output` times `factor`: a tensor, or the floating tensors of a tuple/list/dict."""
    if isinstance(output, (tuple, list)):
        return type(output)(_poison(o, factor) for o in output)
    if isinstance(output, dict):
        return {k: _poison(v, factor) for k, v in output.items()}
    if hasattr(output, "is_floating_point") and output.is_floating_point():
        return output * factor
    return output


def forward_hook(
    faults: list[Fault], rank: int, current_step: Callable[[], int]
) -> Callable[[Any, Any, Any], Any]:
    """A forward post-hook applying `nan_loss`, `inf_loss`, `sigkill`, `hang`, `slow` and
    `sigterm` after the model's forward pass."""
    announced: set[Fault] = set()
    pause = slow_seconds() if any(f.kind == "slow" for f in faults) else 0.0

    def hook(_layer: Any, _inputs: Any, output: Any) -> Any:
        step = current_step()
        for fault in faults:
            if not fault.hits(step, rank):
                continue
            if fault.kind == "sigkill":
                _announce(fault, rank, "SIGKILL after the forward pass")
                _kill_self()
            if fault.kind == "hang":
                _announce(fault, rank, "stops answering after the forward pass")
                _hang()
            if fault.kind == "slow":
                if fault not in announced:
                    _announce(fault, rank, f"{pause:g} s more per step from here on")
                    announced.add(fault)
                time.sleep(pause)
            if fault.kind == "sigterm" and fault not in announced:
                _announce(fault, rank, "SIGTERM to itself after the forward pass")
                announced.add(fault)
                os.kill(os.getpid(), signal.SIGTERM)
            if fault.kind in ("nan_loss", "inf_loss"):
                if fault not in announced:
                    _announce(fault, rank, "model output made non-finite")
                    announced.add(fault)
                output = _poison(output, math.nan if fault.kind == "nan_loss" else math.inf)
        return output

    return hook


def grad_hook(
    faults: list[Fault], rank: int, current_step: Callable[[], int]
) -> Callable[[Any], Any]:
    """A gradient hook turning the gradient NaN at the steps of `nan_grad` faults."""
    announced: set[Fault] = set()

    def hook(grad: Any) -> Any:
        step = current_step()
        for fault in faults:
            if fault.kind == "nan_grad" and fault.hits(step, rank):
                if fault not in announced:
                    _announce(fault, rank, "gradient made NaN")
                    announced.add(fault)
                return grad * math.nan
        return grad

    return hook


def install(
    model: paddle.nn.Layer,
    params: Sequence[tuple[str, paddle.Tensor]],
    steps_done: Callable[[], int],
    faults: list[Fault] | None = None,
    *,
    rank: int | None = None,
) -> list[Fault]:
    """Hook `model` (a rank's trained module) for the forward/gradient faults that apply to
    `rank` (default: this process's, from the launcher's environment).

    `params` are its trainable `(name, parameter)` pairs (`nan_grad` poisons the first);
    `steps_done()` the steps done so far (the running step is one more). Returns the faults
    installed (empty, and nothing touched, when `FLASHCP_FAULT` is unset).
    """
    faults = active_faults() if faults is None else faults
    rank = _rank() if rank is None else int(rank)
    mine = [f for f in faults if f.rank is None or f.rank == rank]
    if not mine:
        return []

    def current_step() -> int:
        return int(steps_done()) + 1

    if any(f.kind in FORWARD_KINDS for f in mine):
        model.register_forward_post_hook(forward_hook(mine, rank, current_step))
    if any(f.kind == "nan_grad" for f in mine):
        if not params:
            raise FaultSpecError(f"{ENV_FAULT}: nan_grad needs a trainable parameter")
        params[0][1].register_hook(grad_hook(mine, rank, current_step))
    return mine


def on_checkpoint_write(step: int, tmp_dir: Path) -> None:
    """Fault point of the checkpoint writers: a file written, the manifest not yet (a torn
    write)."""
    if ENV_FAULT not in os.environ:
        return
    rank = _rank()
    for fault in active_faults():
        if fault.kind == "crash_in_checkpoint_write" and fault.hits(step, rank):
            _announce(fault, rank, f"SIGKILL while writing {tmp_dir}")
            _kill_self()


def on_save_write(step: int, tmp_dir: Path, rank: int | None = None) -> None:
    """Fault point at the start of rank `rank`'s part (default: this process's) of checkpoint
    `step`: raise the `OSError` of a `save_enospc` / `save_eacces` / `save_eio` fault (what a
    full disk, a permission or a failing device raises from `open` or `write`)."""
    if ENV_FAULT not in os.environ:
        return
    rank = _rank() if rank is None else rank
    for fault in active_faults():
        code = SAVE_ERRORS.get(fault.kind)
        if code is not None and fault.hits(step, rank):
            _announce(fault, rank, f"{errno.errorcode[code]} while saving into {tmp_dir}")
            raise OSError(code, os.strerror(code), str(tmp_dir))
