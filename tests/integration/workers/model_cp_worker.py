"""Worker: every model architecture under CP = N matches the same model at CP = 1.

For GPT, GLM-4 and GLM-4.5-MoE, every CP mode and every recompute mode, this rank's logits
must equal the single-process logits at its global positions, and the parameter gradients
(summed over the CP group) must equal the single-process gradients, within the float32 rule of
`bench.numerics` (logits: reductions over the S keys, scale max |logit|; gradients
norm-wise, a sum over the target tokens). The loss is normalised by the GLOBAL count of target
tokens and labels are shifted on the full sequence before sharding, as the trainer does.

Negative controls (recompute none): another rank's logits (a wrong shard), and gradients of
labels shifted AFTER sharding (wrong only at the chunk boundaries: a few tokens of 32) must
both miss the allowance by a wide margin. Results go to `<out>/rank<r>.json`; a mismatch or
an accepted negative control raises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

from bench.numerics import FACTOR, compare, labels_shifted_after_sharding
from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.attention.registry import MODES, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    init_distributed,
    shutdown,
)
from flashcp.models import build_model, preset

B, S, VOCAB = 2, 32, 260
ARCHS = ("tiny", "tiny_glm", "tiny_glm_moe")
FAMILIES = ("tiny_ernie", "tiny_ernie_moe", "tiny_llama", "tiny_qwen2", "tiny_qwen3",
            "tiny_qwen3_moe")  # fmt: skip
"""The other families' tiny presets: every CP mode, without recompute (recompute is the same
shared decoder code, covered by `ARCHS`)."""
RECOMPUTE = ("none", "full", "refined")


def loss_sum(logits: paddle.Tensor, labels: np.ndarray, count: int) -> paddle.Tensor:
    target = paddle.to_tensor(labels).unsqueeze(-1)
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / count


def grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


WRONG_MARGIN = 10.0
"""A negative control must miss the allowance by at least this factor."""


def grad_units(got: dict, want: dict, count: int, label: str = "grad") -> float:
    """The largest per-parameter gradient error in units of the rule (ok when <= FACTOR)."""
    return max(
        compare(got[k], want[k], n=count, norm="l2", what=f"{label} {k}").units for k in want
    )


def run_model(name, rc, ids, positions, labels, count, ctx):
    """Forward + backward of a fresh seed-0 model: (logits, this rank's gradients)."""
    paddle.seed(0)
    model = build_model(preset(name, recompute=rc))
    logits = model.logits(model(paddle.to_tensor(ids), paddle.to_tensor(positions), ctx))
    loss_sum(logits, labels, count).backward()
    return logits.numpy(), grads(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    env = init_distributed()
    world = env.world_size
    group = build_groups(ParallelDims(dp=1, pp=1, cp=world, world_size=world)).cp
    rank = group.rank
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (B, S))
    # Labels shifted on the FULL sequence; no prediction across document ends.
    doc_lens = [[10, 22], [7, 9, 16]]
    labels = np.roll(ids, -1, axis=1)
    for b, lens in enumerate(doc_lens):
        labels[b, np.cumsum(lens) - 1] = -100
    mask = masks.causal_document_mask(doc_lens).indices
    count = int((labels != -100).sum())
    positions = np.broadcast_to(np.arange(S), (B, S))

    cases = []
    for name in ARCHS + FAMILIES:
        paddle.seed(0)
        ref = build_model(preset(name))
        ref_ctx = AttentionContext(mask=mask, causal=True)
        ref_logits = ref.logits(ref(paddle.to_tensor(ids), paddle.to_tensor(positions), ref_ctx))
        loss_sum(ref_logits, labels, count).backward()
        ref_logits, ref_grads = ref_logits.numpy(), grads(ref)
        for mode in MODES:
            asg = make_assignment(mode, world, mask, causal=True)
            pos = asg.positions(S, rank)
            local_ids = shard_assigned(ids, rank, asg)
            local_labels = shard_assigned(labels, rank, asg)
            local_pos = np.ascontiguousarray(positions[:, pos])
            for rc in RECOMPUTE if name in ARCHS else ("none",):
                ctx = AttentionContext(
                    mask=mask, causal=True, group=group, assignment=asg, mode=mode
                )
                logits, local = run_model(name, rc, local_ids, local_pos, local_labels, count, ctx)
                got = {k: all_reduce_tensor(paddle.to_tensor(g), group).numpy()
                       for k, g in local.items()}  # fmt: skip
                logit_units = compare(logits, ref_logits[:, pos], n=S, what="logits").units
                grad_err = (
                    grad_units(got, ref_grads, count)
                    if got.keys() == ref_grads.keys()
                    else float("inf")
                )
                case = {
                    "arch": name,
                    "mode": mode,
                    "recompute": rc,
                    "logit_units": logit_units,
                    "grad_units": grad_err,
                    "ok": logit_units <= FACTOR and grad_err <= FACTOR,
                }
                if rc == "none" and world > 1:
                    other = asg.positions(S, (rank + 1) % world)
                    case["wrong_shard_units"] = compare(
                        logits, ref_logits[:, other], n=S, what="wrong shard logits"
                    ).units
                    bad_labels = labels_shifted_after_sharding(local_ids, local_labels)
                    ctx = AttentionContext(
                        mask=mask, causal=True, group=group, assignment=asg, mode=mode
                    )
                    _, bad = run_model(name, rc, local_ids, local_pos, bad_labels, count, ctx)
                    bad = {k: all_reduce_tensor(paddle.to_tensor(g), group).numpy()
                           for k, g in bad.items()}  # fmt: skip
                    case["label_shift_units"] = grad_units(
                        bad, ref_grads, count, "label-shift grad"
                    )
                    case["ok"] = (
                        case["ok"]
                        and min(case["wrong_shard_units"], case["label_shift_units"])
                        > WRONG_MARGIN * FACTOR
                    )
                cases.append(case)
                print(f"CASE {name} {mode} {rc} logits {logit_units:.2f} grads {grad_err:.2f} "
                      f"(units; allowed {FACTOR:g}) {case}", flush=True)  # fmt: skip
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"world": world, "cases": cases}))
    bad = [c for c in cases if not c["ok"]]
    if bad:
        raise SystemExit(f"rank {rank}: {len(bad)} mismatches: {bad[:3]}")
    shutdown()


if __name__ == "__main__":
    main()
