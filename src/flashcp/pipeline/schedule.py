"""The pure logic of pipeline schedules: which pass or transfer each stage does when.

Nothing here touches tensors or processes, so every property is unit-testable.

* `schedule_1f1b` / `schedule_gpipe`: the order of forward ("F") and backward ("B") passes of
  one stage. 1F1B: stage s runs `pp - s - 1` warm-up forwards, then alternates one forward
  and one backward, then drains the remaining backwards, so at most `pp - s` micro-batches
  are in flight (forwarded, not yet back-propagated) on stage s, against all of them under
  GPipe. Backward runs micro-batches in ascending order in both, like a single process that
  accumulates micro-batches one by one (so gradients can match it bitwise).
* `comm_plan`: that order with the send / recv around each pass. Gloo sends block until the
  peer receives, so both ends of every link must list their operations on it in the same
  order. "Receive before, send after" each pass nearly does it; the one fix is the 1F1B
  steady state, where stage s sends activation m and then waits for gradient k from stage
  s+1, while s+1, having finished backward k, would send gradient k and then wait for
  activation m. Stage s+1 therefore receives the activation first, then sends the gradient
  (Megatron pairs the same two transfers in `send_backward_recv_forward`).
* `simulate_plans`: runs every stage's plan with rendezvous (blocking) send / recv and raises
  on a deadlock or a mismatched pair. Same-order links on a chain of stages cannot deadlock;
  the simulation checks it for the plans actually used, once per micro-batch count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
ScheduleKind = Literal["1f1b", "gpipe"]
FORWARD = "forward"
"""The forward-only plan kind (`schedule_forward`), for passes without gradients."""
OP_KINDS: tuple[str, ...] = ("F", "B", "recv_act", "send_act", "recv_grad", "send_grad")


class Op(NamedTuple):
    """One step of a stage's plan, for micro-batch `micro`: a pass ("F", "B") or a transfer
    ("recv_act", "send_act" to the next stage, "recv_grad", "send_grad" to the previous)."""

    kind: str
    micro: int


def _check_args(pp: int, num_micro: int, stage: int) -> None:
    if pp < 1:
        raise ValueError(f"parallel.pp must be >= 1, got {pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}")
    if num_micro < pp:
        raise ValueError(
            f"{num_micro} micro-batches for {pp} pipeline stages: the schedule needs at least "
            f"pp = {pp} micro-batches per step to fill the pipeline (raise the micro-batch "
            "count or lower parallel.pp)"
        )


def schedule_1f1b(pp: int, num_micro: int, stage: int) -> list[Op]:
    """The 1F1B order of passes of `stage`: warm-up forwards, steady F/B pairs, cool-down B."""
    _check_args(pp, num_micro, stage)
    warmup = min(pp - stage - 1, num_micro)
    order = [Op("F", m) for m in range(warmup)]
    for i in range(num_micro - warmup):
        order += [Op("F", warmup + i), Op("B", i)]
    order += [Op("B", m) for m in range(num_micro - warmup, num_micro)]
    return order


def schedule_gpipe(pp: int, num_micro: int, stage: int) -> list[Op]:
    """GPipe: every forward, then every backward (ascending, like sequential accumulation)."""
    _check_args(pp, num_micro, stage)
    return [Op("F", m) for m in range(num_micro)] + [Op("B", m) for m in range(num_micro)]


def schedule_forward(pp: int, num_micro: int, stage: int) -> list[Op]:
    """Forward only (no gradients, e.g. DPO reference log-probs): every forward, in order.

    Unlike the training schedules any number of micro-batches >= 1 works: nothing waits for a
    backward pass, so the stages simply stream the micro-batches through.
    """
    if pp < 1:
        raise ValueError(f"parallel.pp must be >= 1, got {pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}")
    if num_micro < 1:
        raise ValueError(f"a forward pass needs >= 1 micro-batch, got {num_micro}")
    return [Op("F", m) for m in range(num_micro)]


SCHEDULE_FNS: dict[str, Callable[[int, int, int], list[Op]]] = {
    "1f1b": schedule_1f1b,
    "gpipe": schedule_gpipe,
}


def max_in_flight(order: Sequence[Op]) -> int:
    """Most micro-batches forwarded but not yet back-propagated at any point of `order`."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def comm_plan(order: Sequence[Op], stage: int, pp: int) -> list[Op]:
    """`order` with the transfers of each pass, in an order both link ends agree on."""
    ops: list[Op] = []
    for kind, m in order:
        if kind == "F":
            if stage > 0:
                ops.append(Op("recv_act", m))
            ops.append(Op("F", m))
            if stage < pp - 1:
                ops.append(Op("send_act", m))
        elif kind == "B":
            if stage < pp - 1:
                ops.append(Op("recv_grad", m))
            ops.append(Op("B", m))
            if stage > 0:
                ops.append(Op("send_grad", m))
        else:
            raise ValueError(f"schedule step {kind!r} is neither 'F' nor 'B'")
    # The previous stage sends the next activation before it waits for this gradient.
    out: list[Op] = []
    i = 0
    while i < len(ops):
        if i + 1 < len(ops) and ops[i].kind == "send_grad" and ops[i + 1].kind == "recv_act":
            out += [ops[i + 1], ops[i]]
            i += 2
        else:
            out.append(ops[i])
            i += 1
    return out


def build_plans(kind: str, pp: int, num_micro: int) -> list[list[Op]]:
    """Every stage's communication plan for schedule `kind` (or "forward": forward only)."""
    if kind not in SCHEDULE_FNS and kind != FORWARD:
        raise ValueError(
            f"pipeline schedule {kind!r} is unknown: use one of {', '.join(SCHEDULES)}"
        )
    fn = schedule_forward if kind == FORWARD else SCHEDULE_FNS[kind]
    return [comm_plan(fn(pp, num_micro, s), s, pp) for s in range(pp)]


_PEER_OP = {"send_act": "recv_act", "send_grad": "recv_grad"}


def simulate_plans(plans: Sequence[Sequence[Op]]) -> list[tuple[int, Op]]:
    """Run all stages' plans with blocking (rendezvous) send / recv; the global trace.

    A send to stage s±1 completes together with the matching receive there. Raises
    `RuntimeError` describing each stage's pending step when no stage can progress.
    """
    pp = len(plans)
    pos = [0] * pp
    trace: list[tuple[int, Op]] = []

    def current(s: int) -> Op | None:
        return plans[s][pos[s]] if pos[s] < len(plans[s]) else None

    while any(current(s) is not None for s in range(pp)):
        progressed = False
        for s in range(pp):
            op = current(s)
            if op is None:
                continue
            if op.kind in ("F", "B"):
                trace.append((s, op))
                pos[s] += 1
                progressed = True
            elif op.kind in _PEER_OP:
                peer = s + 1 if op.kind == "send_act" else s - 1
                if 0 <= peer < pp and current(peer) == Op(_PEER_OP[op.kind], op.micro):
                    trace += [(s, op), (peer, plans[peer][pos[peer]])]
                    pos[s] += 1
                    pos[peer] += 1
                    progressed = True
        if not progressed:
            pending = ", ".join(f"stage {s}: {current(s)}" for s in range(pp))
            raise RuntimeError(f"pipeline plan deadlocks (blocking send/recv): {pending}")
    return trace
