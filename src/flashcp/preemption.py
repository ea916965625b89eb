"""Pre-emption, from the trainer's side: whether a pre-emption fits `run.preempt_grace_s`, and
what rank 0 says when one is asked for.

A pre-emption request (a signal, `flashcp.launch.preempt`) rides on a step's exchange; the run
then finishes the step, saves it and stops. That takes up to two steps (a signal that arrives
after a step's numbers were exchanged is acted on at the next step) and a whole save
(`preempt_seconds`), and must fit the scheduler's grace period, `run.preempt_grace_s`. It is
judged twice: at the start by the plan (`planned_grace_warning`, with
`hardware.checkpoint_write_gb_per_s`), and at the first committed save by its measured time
(`GraceCheck`); either prints a warning (`grace_warning`) when it does not fit.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

from flashcp.checkpoint.saving import SAVED, STALL, SaveReport
from flashcp.config import Config
from flashcp.plan import plan
from flashcp.plan.steptime import estimate

_SIGNALS = {int(s) for s in signal.Signals}


def preempt_seconds(step_s: float | None, save_s: float) -> float:
    """Seconds a pre-emption may take: up to two steps (a signal that arrives after a step's
    numbers were exchanged is acted on at the next step, `flashcp.launch.preempt`), then the
    save."""
    return 2.0 * (step_s or 0.0) + save_s


def grace_warning(cfg: Config, *, step_s: float | None, save_s: float, basis: str) -> str | None:
    """The warning when `run.preempt_grace_s` cannot fit a pre-emption (`preempt_seconds`) of
    steps of `step_s` (None: unknown) and a save of `save_s` (`basis`: where that comes from);
    None when it fits."""
    need = preempt_seconds(step_s, save_s)
    grace = cfg.run.preempt_grace_s
    if need <= grace:
        return None
    steps = f"up to two steps of {step_s:.3g} s and " if step_s else ""
    return (
        f"warning: run.preempt_grace_s is {grace:g} s but a pre-emption here needs about "
        f"{need:.3g} s ({steps}a save of {basis}): raise run.preempt_grace_s and the "
        "scheduler's grace period to fit it, or a pre-empted run loses the steps since its last "
        "checkpoint"
    )


def planned_grace_warning(cfg: Config, device: str | None = None) -> str | None:
    """`grace_warning` by the plan, at start: the most bytes one rank writes per checkpoint
    (`flashcp.plan`) at `hardware.checkpoint_write_gb_per_s`, and the plan's step-time estimate
    (with `hardware.peak_tflops`); None without a write bandwidth (the first save is judged
    instead) or when it fits."""
    bandwidth = cfg.hardware.checkpoint_write_gb_per_s
    if bandwidth is None:
        return None
    p = plan(cfg, device=device)
    most = max((r.checkpoint_bytes for r in p.host.ranks), default=0) if p.host else 0
    step = estimate(cfg, device=device).seconds
    return grace_warning(cfg, step_s=step, save_s=most / (bandwidth * 1e9),
                         basis=f"{most / 2**30:.3g} GiB per writer at {bandwidth:g} GB/s, by the "
                         "plan")  # fmt: skip


class GraceCheck:
    """Judges, once, at the first committed save, whether a pre-emption fits
    `run.preempt_grace_s`: up to two steps of the committing step's time and a whole save —
    the stall of the step that saved it, plus with `checkpoint.async` its background write
    (`write_s()`, the checkpointer's last write)."""

    def __init__(self, cfg: Config, write_s: Callable[[], float]) -> None:
        self.cfg = cfg
        self.write_s = write_s
        self.judged = False
        self.stalls: dict[int, float] = {}
        """The stall of each save by step, until the first commit is judged."""

    def observe(self, step: int, step_s: float, saved: SaveReport, due: bool) -> str | None:
        """Step `step` (of `step_s` seconds) ended with the checkpointer's report `saved` (a
        save when `due`); the warning to print when the first commit it reports shows that a
        pre-emption does not fit, else None."""
        stall = float(saved.metrics.get(STALL, 0.0))
        if due:
            self.stalls[step] = stall
        committed = saved.metrics.get(SAVED)
        if self.judged or committed is None:
            return None
        self.judged = True
        at = int(committed)
        save_s = self.stalls.get(at, stall)
        if self.cfg.checkpoint.async_:
            save_s += self.write_s()
        basis = f"{save_s:.3g} s, as the one of step {at} took"
        return grace_warning(self.cfg, step_s=step_s, save_s=save_s, basis=basis)


def stop_message(step: int, requests: Mapping[int, int]) -> str:
    """What rank 0 says when the step's exchange carried pre-emption `requests` (rank →
    signal number)."""
    asked = ", ".join(
        f"{r} ({signal.Signals(s).name if s in _SIGNALS else f'signal {s}'})"
        for r, s in sorted(requests.items())
    )
    return (
        f"pre-emption requested on rank(s) {asked}: saving step {step} and stopping "
        "(run the same command again to resume)"
    )
