"""Worker: several trainer runs, one after the other, in ONE launched job (saves start-up time).

Run under `paddle.distributed.launch`; `--plan` is a JSON list of runs, each
`{"config": path, "overrides": [...], "toy": bool}`. For each run every rank loads the config
for this world, builds the process groups of its dp × pp × cp layout, trains with the real
`Trainer` (which writes `metrics.jsonl` and checkpoints under the run's `run.output_dir`) and
releases the groups before the next run. `toy` swaps the model for `tests/bf16toy.Bf16ToyLM`
(bfloat16 storage, float32 compute) to exercise float32 `main_grad` reduction and master weights
across ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
from flashcp.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    env = init_distributed()
    for run in plan:
        cfg = load_config(run["config"], run["overrides"], world_size=env.world_size)
        p = cfg.parallel
        groups = build_groups(ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size))
        factory = None
        if run.get("toy"):

            def factory(c):  # type: ignore[no-untyped-def]
                return Bf16ToyLM(vocab=int(c.model.vocab_size), seed=c.train.seed)

        Trainer(cfg, groups, model_factory=factory).fit()
        barrier(groups.world)
        destroy_groups(groups)
        print(f"[zero_worker] rank {env.rank} done: {cfg.run.output_dir}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
