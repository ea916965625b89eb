"""Worker: a CP mode registered from outside `src/` runs the model at CP = N like CP = 1.

`reversed_contiguous` (N chunks, rank r holds chunk N-1-r, `helpers.toy_cp_mode`, with an alias
of the all-gather-KV implementation that counts its calls) is registered in
`flashcp.attention.registry` here; nothing in `src/` names it. The context carries only the
group and the mode name: the registry makes the layout and picks the implementation. GLM-4
tiny, recompute none and refined: this rank's hidden states must equal the single-process ones
at its global positions, and the parameter gradients summed over the group the single-process
gradients, within the float32 rule of `bench.numerics`; another rank's rows (a wrong shard)
must miss by a wide margin. Results go to `<out>/rank<r>.json`; a mismatch raises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import paddle

from bench.numerics import FACTOR, compare
from flashcp import masks
from flashcp.attention import registry as cp_modes
from flashcp.attention.context import AttentionContext
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    init_distributed,
    shutdown,
)
from flashcp.models import build_model, preset
from helpers.toy_cp_mode import IMPLEMENTATION, TOY_IMPL, reversed_contiguous

B, S, VOCAB, LAYERS = 2, 32, 260, 2
MODE = "reversed_contiguous"
WRONG_MARGIN = 10.0


cp_modes.register(cp_modes.CPMode(MODE, 1, reversed_contiguous, implementation=IMPLEMENTATION))


def run(recompute: str, ids, positions, weights, ctx) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Forward + backward of a fresh seed-0 model: (hidden states, this rank's gradients).

    The loss weighs every hidden value by a fixed random number of its global position (a
    per-token gradient; the final norm makes sum(hidden²) nearly flat in its inputs)."""
    paddle.seed(0)
    model = build_model(preset("tiny_glm", recompute=recompute, num_layers=LAYERS))
    hidden = model(paddle.to_tensor(ids), paddle.to_tensor(positions), ctx)
    (hidden * paddle.to_tensor(weights)).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.numpy(), grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = init_distributed().world_size
    group = build_groups(ParallelDims(dp=1, pp=1, cp=world, world_size=world)).cp
    rank = group.rank
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (B, S))
    weights = rng.standard_normal((B, S, preset("tiny_glm").hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(S), (B, S))
    mask = masks.causal_document_mask([[10, 22], [7, 9, 16]]).indices

    asg = cp_modes.make_assignment(MODE, world)
    mine, other = asg.positions(S, rank), asg.positions(S, (rank + 1) % world)
    local_ids, local_weights = shard_assigned(ids, rank, asg), shard_assigned(weights, rank, asg)
    local_pos = np.ascontiguousarray(positions[:, mine])
    cases = []
    for recompute in ("none", "refined"):
        plain = AttentionContext(mask=mask, causal=True)
        want, want_grads = run(recompute, ids, positions, weights, plain)
        TOY_IMPL.calls.clear()
        ctx = AttentionContext(mask=mask, causal=True, group=group, mode=MODE)
        got, local_grads = run(recompute, local_ids, local_pos, local_weights, ctx)
        calls = dict(TOY_IMPL.calls)
        grads = {k: all_reduce_tensor(paddle.to_tensor(g), group).numpy()
                 for k, g in local_grads.items()}  # fmt: skip
        hidden_units = compare(got, want[:, mine], n=S, what="hidden").units
        grad_units = max(
            compare(grads[k], want_grads[k], n=B * S, norm="l2", what=k).units for k in want_grads
        )
        wrong_units = compare(got, want[:, other], n=S, what="wrong shard").units
        case = {
            "recompute": recompute,
            "chunks": list(asg.ranks[rank]),
            "calls": calls,
            "hidden_units": hidden_units,
            "grad_units": grad_units,
            "wrong_shard_units": wrong_units,
            "ok": hidden_units <= FACTOR
            and grad_units <= FACTOR
            and wrong_units > WRONG_MARGIN * FACTOR
            and calls == {"plan": 1, "forward": LAYERS, "backward": LAYERS},
        }
        cases.append(case)
        print(f"CASE {case}", flush=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"world": world, "cases": cases}))
    bad = [c for c in cases if not c["ok"]]
    if bad:
        raise SystemExit(f"rank {rank}: {len(bad)} mismatches: {bad}")
    shutdown()


if __name__ == "__main__":
    main()
