"""Worker: a pipeline-parallel training step equals the same step on one process.

Run under `paddle.distributed.launch` with `pp × cp` processes (`--pp`, `--cp`). For each case
(model preset, layer split, schedule, tied embeddings, recompute) every rank builds, from seed
0, the whole model for the references and its stage ALONE (`build_stage`) for the pipeline:

* computes the single-process reference (PP = 1, CP = 1): each micro-batch's summed
  cross-entropy divided by the GLOBAL target count, back-propagated one micro-batch after the
  other; the gradients accumulate;
* with CP, also the CP-only reference (PP = 1, CP = cp on this rank's cp group, same shards);
* the pipeline step: its stage, built on its own, run by `PipelineRunner` on its pp group.

Every loss is the LM recipe's own (`flashcp.recipes.lm.LMRecipe.loss`: summed cross-entropy)
divided by the step's global target count (`flashcp.recipes.base.normalised`).

Checks: every stage parameter's gradient is BITWISE equal to the reference gradient of the
same name (the PP = 1 one without CP; the CP-only one with CP, i.e. before any cp reduction),
and the micro-batch losses and step loss (summed over the pp group as the trainer does) are
bitwise equal (same operations, same order: bitwise by construction); with CP the gradients
summed over the cp group and the loss summed over cp match the PP = 1, CP = 1 reference
within the float32 rule of `bench.numerics` (CP changes the summation order inside
attention and across the sequence; gradients norm-wise, n = the step's target tokens). A tied
embedding/head matrix is compared under the same rule: one process adds its embedding and head
gradients per micro-batch, the pipeline adds the two stages' totals once. Negative control
(with CP): the same CP-only step with labels shifted after sharding must miss the allowance by
a wide margin. Results go to `<out>/rank<r>.json`; any mismatch raises.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paddle

from bench.numerics import FACTOR, compare, labels_shifted_after_sharding
from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.attention.registry import make_assignment
from flashcp.config import IGNORE_INDEX, build_config
from flashcp.cp.layout import shard_assigned
from flashcp.distributed import (
    ParallelDims,
    all_reduce_tensor,
    build_groups,
    comm_stats,
    init_distributed,
    reset_comm_stats,
    shutdown,
)
from flashcp.models import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    HeadInput,
    build_model,
    preset,
)
from flashcp.pipeline.runner import MicroBatch, PipelineRunner
from flashcp.pipeline.stage import build_stage
from flashcp.recipes.base import normalised
from flashcp.recipes.lm import LMRecipe

B, S, VOCAB = 2, 32, 260
MODE = "dualchunk_allgather"
WRONG_MARGIN = 10.0
"""The negative control must miss the allowance by at least this factor."""


@dataclass
class Case:
    name: str
    model: str
    num_micro: int
    overrides: dict = field(default_factory=dict)
    pp_layers: list[int] | None = None
    kind: str = "1f1b"


def cases_for(pp: int, cp: int) -> list[Case]:
    if cp > 1:
        return [
            Case("gpt", "tiny", pp + 1),
            Case("glm", "tiny_glm", pp),
            Case("glm_gpipe", "tiny_glm", pp + 1, kind="gpipe"),
        ]
    if pp == 2:
        return [
            Case("gpt", "tiny", 5),
            Case("glm", "tiny_glm", 4),
            Case("gpt_tied", "tiny", 4, {"tie_embeddings": True}),
            Case("ernie_tied", "tiny_ernie", 4),  # tied by its family, biases everywhere
            Case("qwen3_moe", "tiny_qwen3_moe", 3),
            Case(
                "glm_3layers_recompute",
                "tiny_glm",
                3,
                {"num_layers": 3, "recompute": "full"},
                pp_layers=[1, 2],
            ),
            Case("gpt_gpipe", "tiny", 3, kind="gpipe"),
        ]
    layers = pp + 1  # uneven default split: the first stage gets the extra layer
    return [
        Case("gpt", "tiny", pp, {"num_layers": layers}),
        Case("glm", "tiny_glm", 2 * pp + 1, {"num_layers": layers}),
        Case("gpt_tied", "tiny", pp + 1, {"num_layers": layers, "tie_embeddings": True}),
        Case("qwen2_tied", "tiny_qwen2", pp + 1, {"num_layers": layers}),
    ]


def make_micro_batches(num_micro: int) -> list[dict]:
    """Global (unsharded) micro-batches: ids, labels shifted per document, document mask."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(num_micro):
        ids = rng.integers(0, VOCAB, (B, S))
        labels = np.roll(ids, -1, axis=1)
        doc_lens = []
        for b in range(B):
            cuts = np.sort(rng.choice(np.arange(4, S - 3), size=2, replace=False))
            lens = np.diff(np.concatenate([[0], cuts, [S]])).tolist()
            labels[b, np.cumsum(lens) - 1] = -100
            doc_lens.append(lens)
        mask = masks.causal_document_mask(doc_lens).indices
        positions = np.broadcast_to(np.arange(S), (B, S)).copy()
        out.append({"ids": ids, "labels": labels, "mask": mask, "positions": positions})
    return out


def local_micro_batches(
    global_mbs: list[dict], group, *, shift_bug: bool = False
) -> list[MicroBatch]:
    """This rank's shards (all of it when `group` is None or has one rank); `shift_bug`: with
    labels shifted after sharding (the negative control)."""
    out = []
    for g in global_mbs:
        if group is None or group.nranks == 1:
            ctx = AttentionContext(mask=g["mask"], causal=True)
            ids, labels, pos = g["ids"], g["labels"], g["positions"]
        else:
            asg = make_assignment(MODE, group.nranks, g["mask"], causal=True)
            ctx = AttentionContext(
                mask=g["mask"], causal=True, group=group, assignment=asg, mode=MODE
            )
            ids = shard_assigned(g["ids"], group.rank, asg)
            labels = shard_assigned(g["labels"], group.rank, asg)
            if shift_bug:
                labels = labels_shifted_after_sharding(ids, labels)
            pos = np.ascontiguousarray(g["positions"][:, asg.positions(S, group.rank)])
        lab = paddle.to_tensor(labels)
        out.append(MicroBatch(paddle.to_tensor(ids), paddle.to_tensor(pos), lab, ctx))
    return out


def lm_loss(count: int):
    """The LM recipe's loss normalised by the step's global target `count`."""
    train = {"loss_chunk_tokens": DEFAULT_LOSS_CHUNK_TOKENS}
    cfg = build_config({"model": {"preset": "tiny"}, "train": train})
    return normalised(LMRecipe(cfg, None).loss, float(count))  # type: ignore[arg-type]


def grads_of(layer) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in layer.named_parameters() if p.grad is not None}


def sequential(case: Case, mbs: list[MicroBatch], loss_fn):
    """PP = 1: the whole model, micro-batches forwarded and back-propagated one by one."""
    model = build_model(preset(case.model, **case.overrides), seed=0)
    losses, total = [], paddle.zeros([], dtype="float32")
    for mb in mbs:
        loss, _ = loss_fn(HeadInput(model(mb.input_ids, mb.positions, mb.attn), model), mb)
        loss.backward()
        losses.append(float(loss))
        total = total + loss.detach()
    return grads_of(model), losses, total


def step_loss(micro_losses: list[float], group) -> paddle.Tensor:
    """The step loss as the trainer forms it: this stage's micro-batch losses summed (float32,
    in order; none but on the last stage), then summed over the pp `group`."""
    total = paddle.zeros([], dtype="float32")
    for x in micro_losses:
        total = total + paddle.to_tensor(x, dtype="float32")
    return all_reduce_tensor(total, group)


def grad_units(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], count: int, label: str = "grad"
) -> float:
    """The largest per-parameter gradient error in units of the rule (ok when <= FACTOR)."""
    return max(
        (compare(got[n], want[n], n=count, norm="l2", what=f"{label} {n}").units for n in got),
        default=0.0,
    )


def run_case(case: Case, groups, pp: int, cp: int) -> dict:
    global_mbs = make_micro_batches(case.num_micro)
    count = int(sum((g["labels"] != IGNORE_INDEX).sum() for g in global_mbs))
    loss_fn = lm_loss(count)
    everything = local_micro_batches(global_mbs, None)
    ref_grads, ref_losses, ref_total = sequential(case, everything, loss_fn)
    local = local_micro_batches(global_mbs, groups.cp)
    if cp > 1:
        same_grads, same_losses, same_total = sequential(case, local, loss_fn)
    else:
        same_grads, same_losses, same_total = ref_grads, ref_losses, ref_total

    # this stage alone (no full model on this rank): the same seed gives the same weights
    stage = build_stage(
        preset(case.model, **case.overrides), groups.pp.rank, pp, case.pp_layers, seed=0
    )
    reset_comm_stats()
    micro_losses, _ = PipelineRunner(stage, groups, kind=case.kind).train(local, loss_fn)
    sent = comm_stats("send").sent
    loss = step_loss(micro_losses, groups.pp)
    got = grads_of(stage)
    tied = stage.tied_weight
    tied_names = {n for n, p in stage.named_parameters() if tied is not None and p is tied}

    bitwise = {n: bool(np.array_equal(g, same_grads[n])) for n, g in got.items() if n in same_grads}
    tied_err = {n: grad_units({n: got[n]}, same_grads, count, "tied grad") for n in tied_names}
    # The step loss is summed over the pp group: every stage must see the same value.
    loss_bitwise = float(loss) == float(same_total)
    micro_bitwise = micro_losses == (same_losses if stage.is_last else [])

    reduced_err = None
    loss_err = None
    shift_units = None
    if cp > 1:
        reduced = {
            n: all_reduce_tensor(paddle.to_tensor(g), groups.cp).numpy() for n, g in got.items()
        }
        reduced_err = grad_units(reduced, ref_grads, count, "cp-reduced grad")
        loss_sum = float(all_reduce_tensor(loss, groups.cp))
        loss_err = compare(loss_sum, float(ref_total), n=count, what="cp loss").units
        # negative control: the CP-only step with labels shifted after sharding
        bad, _, _ = sequential(
            case, local_micro_batches(global_mbs, groups.cp, shift_bug=True), loss_fn
        )
        bad = {n: all_reduce_tensor(paddle.to_tensor(g), groups.cp).numpy() for n, g in bad.items()}
        shift_units = grad_units(bad, ref_grads, count, "label-shift grad")

    non_tied_ok = all(v for n, v in bitwise.items() if n not in tied_names)
    ok = (
        set(got) <= set(ref_grads)
        and non_tied_ok
        and all(e <= FACTOR for e in tied_err.values())
        and loss_bitwise
        and micro_bitwise
        and (reduced_err is None or reduced_err <= FACTOR)
        and (loss_err is None or loss_err <= FACTOR)
        and (shift_units is None or shift_units > WRONG_MARGIN * FACTOR)
    )
    return {
        "case": case.name,
        "kind": case.kind,
        "stage": stage.stage,
        "layers": [stage.layer_range.start, stage.layer_range.stop],
        "params": sorted(got),
        "ref_params": sorted(ref_grads),
        "tied": sorted(tied_names),
        "not_bitwise": sorted(n for n, v in bitwise.items() if not v),
        "tied_err": tied_err,
        "tied_grad_sha": {n: hashlib.sha256(got[n].tobytes()).hexdigest() for n in tied_names},
        "p2p_bytes_sent": sent,
        "num_micro": case.num_micro,
        "tied_embeddings": bool(preset(case.model, **case.overrides).tie_embeddings),
        "loss": float(loss),
        "loss_bitwise": loss_bitwise,
        "micro_bitwise": micro_bitwise,
        "cp_reduced_grad_err": reduced_err,
        "cp_loss_err": loss_err,
        "label_shift_units": shift_units,
        "ok": bool(ok),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument(
        "--hang-stage", type=int, default=None, help="this stage skips the step and sleeps"
    )
    args = parser.parse_args()
    env = init_distributed()
    dims = ParallelDims(dp=1, pp=args.pp, cp=args.cp, world_size=env.world_size)
    groups = build_groups(dims)
    if args.hang_stage is not None:
        if groups.pp.rank == args.hang_stage:
            time.sleep(120)  # the other stages' watchdog must end the job first
        run_case(Case("gpt", "tiny", args.pp), groups, args.pp, args.cp)
        raise SystemExit("unreachable: the pipeline step should have timed out")
    results = []
    for case in cases_for(args.pp, args.cp):
        res = run_case(case, groups, args.pp, args.cp)
        results.append(res)
        brief = {k: res[k] for k in ("layers", "not_bitwise", "tied_err", "cp_reduced_grad_err")}
        print(f"CASE {case.name} stage {res['stage']} ok={res['ok']} {brief}", flush=True)
    report = {
        "rank": env.rank,
        "pp_rank": groups.pp.rank,
        "cp_rank": groups.cp.rank,
        "pp_group": list(groups.pp.ranks),
        "cases": results,
    }
    Path(args.out, f"rank{env.rank}.json").write_text(json.dumps(report, indent=1))
    bad = [r for r in results if not r["ok"]]
    if bad:
        raise SystemExit(f"rank {env.rank}: {len(bad)} failing cases: {bad}")
    shutdown()


if __name__ == "__main__":
    main()
