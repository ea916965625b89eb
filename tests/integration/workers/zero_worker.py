"""Worker: several trainer runs, one after the other, in ONE launched job (saves start-up time).

Run under `paddle.distributed.launch`; `--plan` is a JSON list of runs, each
`{"config": path, "overrides": [...], "toy": bool}`. For each run every rank loads the config
for this world, builds the process groups of its dp × pp × cp layout, trains with the real
`Trainer` (which writes `metrics.jsonl` and checkpoints under the run's `run.output_dir`) and
releases the groups before the next run. `toy` swaps the model for `helpers.bf16toy.Bf16ToyLM`
(bfloat16 storage, float32 compute) to exercise float32 `main_grad` reduction and master weights
across ranks. An entry `{"check": "tied_main_grad", "out": dir}` (2 ranks) runs
`tied_main_grad` instead.

ZeRO-2 (`parallel.shard_gradients`) entries may add `"measure": dir`: every rank writes
`dir/rank<r>.json` with, per step, the allocator's peak during the micro-batches' forward and
backward and during the optimizer step (`reduce_grads` to `step`), the bytes live before each,
the float32 gradient bytes left on the parameters after backward, the buckets the sharder
reduced during backward, and the stage's trained elements (`measure`); `"bug":
"zero2_overwrite"`: the classic ZeRO-2 bug model for a negative control - each micro-batch's
reduce-scattered slice REPLACES the shard gradient instead of adding to it; and `"fault":
"nan_grad@step2:rank1"` (`flashcp.faults` syntax) installs that fault in the run's trainer.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import paddle

from flashcp.config import load_config
from flashcp.distributed import (
    ParallelDims,
    barrier,
    build_groups,
    destroy_groups,
    init_distributed,
    shutdown,
)
from flashcp.distributed.p2p import pipeline_links
from flashcp.faults import install, parse_faults
from flashcp.metrics import memory
from flashcp.optim import grad_shard
from flashcp.optim.grads import grad_of, numel
from flashcp.optim.trainable import attach_main_grad
from flashcp.pipeline.runner import sync_tied_gradients
from flashcp.trainer import Trainer
from helpers.bf16toy import Bf16ToyLM


def tied_main_grad(out: Path, world_size: int) -> None:
    """Under pp = 2 with a bf16 tied matrix (float32 `main_grad` hooks), the first and last
    stages' float32 gradients are summed by `sync_tied_gradients`: both stages hold
    grad_0 + grad_1 (and zeros count for a stage without one). Writes `out/rank<r>.json`."""
    groups = build_groups(ParallelDims(dp=1, pp=2, cp=1, world_size=world_size))
    links = pipeline_links(groups, tied=True)
    rank = int(groups.pp.rank)
    holder = paddle.nn.Layer()
    w = holder.create_parameter(
        [3, 2], dtype="bfloat16", default_initializer=paddle.nn.initializer.Constant(1.0)
    )
    holder.add_parameter("w", w)
    attach_main_grad(holder, "bfloat16")
    stage = SimpleNamespace(tied_weight=w, is_first=rank == 0)
    results = []
    for backward in (True, rank == 0):  # second round: only the first stage has a gradient
        w.main_grad = None
        if backward:
            (w.astype("float32") * (rank + 1.5)).sum().backward()
        sync_tied_gradients(stage, links.ends)  # type: ignore[arg-type]
        main = w.main_grad
        results.append(
            {"main_grad": main.numpy().tolist(), "dtype": str(main.dtype),
             "grad_is_none": w.grad is None}
        )  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    barrier(groups.world)
    destroy_groups(groups)


def measure(trainer: Trainer, out: Path, rank: int) -> None:
    """Wrap `trainer`'s runner and optimizer so every step records its memory (module
    docstring); the records go to `out/rank<rank>.json` after each step."""
    opt, runner = trainer.optimizer, trainer.runner
    sharder = getattr(opt, "sharder", None)
    records: list[dict[str, Any]] = []
    train, reduce_grads, step = runner.train, opt.reduce_grads, opt.step

    def grad_bytes() -> int:
        grads = [grad_of(p) for p in opt.tensors]
        return sum(4 * numel(g) for g in grads if g is not None and g._is_initialized())

    def timed_train(micro: Any, loss_fn: Any) -> Any:
        gc.collect()  # earlier runs' trainers (reference cycles) go now, not mid-measurement
        records.append({"live_before_backward": memory.allocated_bytes()})
        memory.reset_peak()
        losses = train(micro, loss_fn)
        records[-1].update(
            backward_peak=memory.peak_bytes(),
            live_after_backward=memory.allocated_bytes(),
            full_grad_bytes=grad_bytes(),
            reduced_in_backward=sharder.reductions if sharder is not None else 0,
        )
        return losses

    def timed_reduce() -> None:
        gc.collect()
        records[-1]["live_before_step"] = memory.allocated_bytes()
        memory.reset_peak()
        reduce_grads()

    def timed_step() -> None:
        step()
        records[-1]["step_peak"] = memory.peak_bytes()
        layout = [part.layout for part in opt.parts]
        deferred = [(i, b) for i, lay in enumerate(layout) for b in range(len(lay.buckets))
                    if sharder is not None and sharder.deferred(i, b)]  # fmt: skip
        (out / f"rank{rank}.json").write_text(json.dumps({
            "trained": sum(numel(p) for p in opt.tensors),
            "deferred_numel": sum(layout[i].buckets[b].numel for i, b in deferred),
            "deferred_buckets": len(deferred),
            "shard_numel": sum(lay.numel for lay in layout),
            "buckets": sum(len(lay.buckets) for lay in layout),
            "largest_bucket": max(b.padded(lay.shards) for lay in layout for b in lay.buckets),
            "steps": records,
        }, indent=1))  # fmt: skip

    runner.train = timed_train  # type: ignore[method-assign]
    opt.reduce_grads = timed_reduce  # type: ignore[method-assign]
    opt.step = timed_step  # type: ignore[method-assign]


def overwrite_bug() -> Any:
    """The bug model: a bucket's reduce-scattered slice replaces the shard gradient (only the
    last micro-batch of a step counts). Returns the correct method, to put back."""
    reduce = grad_shard.GradientSharder._reduce

    def wrong(self: Any, state: Any, source: Any) -> None:
        state.shard = None
        reduce(self, state, source)

    grad_shard.GradientSharder._reduce = wrong  # type: ignore[method-assign]
    return reduce


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    env = init_distributed()
    for run in plan:
        if "check" in run:
            tied_main_grad(Path(run["out"]), env.world_size)
            continue
        cfg = load_config(run["config"], run["overrides"], world_size=env.world_size)
        p = cfg.parallel
        groups = build_groups(
            ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, ep=p.ep, world_size=env.world_size)
        )
        factory = None
        if run.get("toy"):

            def factory(c, stage=None):  # type: ignore[no-untyped-def]
                return Bf16ToyLM(vocab=int(c.model.vocab_size), seed=c.train.seed)

        correct = overwrite_bug() if run.get("bug") == "zero2_overwrite" else None
        trainer = Trainer(cfg, groups, model_factory=factory)
        if "fault" in run:
            install(trainer.model, trainer.params, lambda t=trainer: t.step,
                    parse_faults(run["fault"]))  # fmt: skip
        if "measure" in run:
            Path(run["measure"]).mkdir(parents=True, exist_ok=True)
            measure(trainer, Path(run["measure"]), env.rank)
        trainer.fit()
        if correct is not None:
            grad_shard.GradientSharder._reduce = correct  # type: ignore[method-assign]
        barrier(groups.world)
        destroy_groups(groups)
        print(f"[zero_worker] rank {env.rank} done: {cfg.run.output_dir}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
