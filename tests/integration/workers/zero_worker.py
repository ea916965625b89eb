"""Worker: several trainer runs, one after the other, in ONE launched job (saves start-up time).

Run under `paddle.distributed.launch`; `--plan` is a JSON list of runs, each
`{"config": path, "overrides": [...], "toy": bool}`. For each run every rank loads the config
for this world, builds the process groups of its dp × pp × cp layout, trains with the real
`Trainer` (which writes `metrics.jsonl` and checkpoints under the run's `run.output_dir`) and
releases the groups before the next run. `toy` swaps the model for `tests/bf16toy.Bf16ToyLM`
(bfloat16 storage, float32 compute) to exercise float32 `main_grad` reduction and master weights
across ranks. An entry `{"check": "tied_main_grad", "out": dir}` (2 ranks) runs
`tied_main_grad` instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import paddle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: bf16toy

from bf16toy import Bf16ToyLM  # noqa: E402
from flashcp.config import load_config  # noqa: E402
from flashcp.distributed import (  # noqa: E402
    ParallelDims,
    barrier,
    build_groups,
    destroy_groups,
    init_distributed,
    shutdown,
)
from flashcp.distributed.p2p import pipeline_links  # noqa: E402
from flashcp.optim.zero import attach_main_grad
from flashcp.pipeline.runner import sync_tied_gradients
from flashcp.trainer import Trainer


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
        groups = build_groups(ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size))
        factory = None
        if run.get("toy"):

            def factory(c, stage=None):  # type: ignore[no-untyped-def]
                return Bf16ToyLM(vocab=int(c.model.vocab_size), seed=c.train.seed)

        Trainer(cfg, groups, model_factory=factory).fit()
        barrier(groups.world)
        destroy_groups(groups)
        print(f"[zero_worker] rank {env.rank} done: {cfg.run.output_dir}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
