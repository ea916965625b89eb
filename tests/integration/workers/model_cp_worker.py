"""Worker: every model architecture under CP = N matches the same model at CP = 1.

For GPT, GLM-4 and GLM-4.5-MoE, every CP mode and every recompute mode, this rank's logits
must equal the single-process logits at its global positions, and the parameter gradients
(summed over the CP group) must equal the single-process gradients, float32 atol 1e-5. The loss
is normalised by the GLOBAL count of target tokens and labels are shifted on the full sequence
before sharding, as the trainer does. Results go to `<out>/rank<r>.json`; a mismatch raises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

from flashcp import masks
from flashcp.cp import MODES, make_assignment
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    init_distributed,
    shutdown,
)
from flashcp.models import AttentionContext, build_model, preset

B, S, VOCAB = 2, 32, 260
ARCHS = ("tiny", "tiny_glm", "tiny_glm_moe")
RECOMPUTE = ("none", "full", "refined")


def loss_sum(logits: paddle.Tensor, labels: np.ndarray, count: int) -> paddle.Tensor:
    target = paddle.to_tensor(labels).unsqueeze(-1)
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / count


def grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


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
    for name in ARCHS:
        paddle.seed(0)
        ref = build_model(preset(name))
        ref_ctx = AttentionContext(mask=mask, causal=True)
        ref_logits = ref.logits(ref(paddle.to_tensor(ids), paddle.to_tensor(positions), ref_ctx))
        loss_sum(ref_logits, labels, count).backward()
        ref_logits, ref_grads = ref_logits.numpy(), grads(ref)
        for mode in MODES:
            asg = make_assignment(mode, world, mask, causal=True)
            pos = asg.positions(S, rank)
            for rc in RECOMPUTE:
                paddle.seed(0)
                model = build_model(preset(name, recompute=rc))
                ctx = AttentionContext(
                    mask=mask, causal=True, group=group, assignment=asg, mode=mode
                )
                hidden = model(
                    paddle.to_tensor(shard_assigned(ids, rank, asg)),
                    paddle.to_tensor(np.ascontiguousarray(positions[:, pos])),
                    ctx,
                )
                logits = model.logits(hidden)
                loss_sum(logits, shard_assigned(labels, rank, asg), count).backward()
                got = {
                    k: all_reduce_tensor(paddle.to_tensor(g), group).numpy()
                    for k, g in grads(model).items()
                }
                logit_err = float(np.abs(logits.numpy() - ref_logits[:, pos]).max())
                grad_err = max(float(np.abs(got[k] - ref_grads[k]).max()) for k in ref_grads)
                ok = got.keys() == ref_grads.keys() and logit_err < 1e-5 and grad_err < 1e-5
                cases.append(
                    {
                        "arch": name,
                        "mode": mode,
                        "recompute": rc,
                        "logit_err": logit_err,
                        "grad_err": grad_err,
                        "ok": ok,
                    }
                )
                print(f"CASE {name} {mode} {rc} logits {logit_err:.1e} grads {grad_err:.1e}")
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"world": world, "cases": cases}))
    bad = [c for c in cases if not c["ok"]]
    if bad:
        raise SystemExit(f"rank {rank}: {len(bad)} mismatches: {bad[:3]}")
    shutdown()


if __name__ == "__main__":
    main()
