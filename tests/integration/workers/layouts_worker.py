"""Worker: several training runs, one after another, in ONE launched job (each its own layout).

    python -m paddle.distributed.launch --nproc_per_node 4 layouts_worker.py SPEC.json

SPEC.json is a list of `{"name", "config", "overrides"}`; every process trains each run with
`flashcp.trainer.Trainer` on its own process groups (built for the run's dp × pp × cp × ep,
torn down after it), so the launch and start-up are paid once for all of them
(`tests/integration/test_layouts_multiproc.py`). Prints `RUN DONE <name>` per run and
`WORKER DONE` at the end; any failure raises (the job exits non-zero).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashcp.config import load_config
from flashcp.distributed import ParallelDims, build_groups, destroy_groups, init_distributed
from flashcp.distributed import shutdown as shutdown_distributed
from flashcp.trainer import Trainer


def main(spec_path: str) -> int:
    runs = json.loads(Path(spec_path).read_text())
    env = init_distributed()
    for run in runs:
        cfg = load_config(run["config"], run["overrides"], world_size=env.world_size)
        p = cfg.parallel
        dims = ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size, ep=p.ep)
        groups = build_groups(dims)
        Trainer(cfg, groups).fit()
        destroy_groups(groups)
        print(f"RUN DONE {run['name']}", flush=True)
    shutdown_distributed()
    print("WORKER DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
