"""Worker: flashcp's rank entry (`flashcp.launch.worker.run`) with one deliberate expert-
parallelism bug, for the negative control of `tests/integration/test_expert_parallel.py`.

The bug (a wrong expert offset): every rank's routed experts are initialised as the NEXT ep
rank's (`first_expert` shifted by the experts per rank), while the dispatch still sends each
token to the rank that owns its expert by index, so tokens meet another expert's weights. The
run is otherwise the real one (same config, same launch); its losses and gradients must fail the
equivalence comparison by a wide margin.

    python -m paddle.distributed.launch --nproc_per_node 2 ep_bug_train.py --config ... [k=v ...]
"""

from __future__ import annotations

import sys

from flashcp.models import moe
from flashcp.models.experts import GroupedExperts


class ShiftedExperts(GroupedExperts):
    """`GroupedExperts` holding the experts one ep rank further on (cyclically)."""

    def __init__(self, num_experts: int, *args: object, **kwargs: object) -> None:
        total = int(kwargs.get("total_experts") or num_experts)  # type: ignore[call-overload]
        first = int(kwargs.get("first_expert", 0))  # type: ignore[call-overload]
        kwargs["first_expert"] = (first + num_experts) % total
        super().__init__(num_experts, *args, **kwargs)  # type: ignore[arg-type]


moe.GroupedExperts = ShiftedExperts  # type: ignore[misc]

if __name__ == "__main__":
    from flashcp.launch.worker import run

    sys.exit(run(sys.argv[1:]))
