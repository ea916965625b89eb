"""`run_info.json`: what each rank of a run built, written by rank 0 at the start of `fit`.

    {"world": 4, "degrees": {"dp": 1, "pp": 2, "cp": 2, "ep": 1}, "device": "cpu",
     "param_dtype": "float32", "compute_dtype": "float32",
     "global_batch": {"sequences": 4, "seq_len": 256, "tokens": 1024,
                      "micro_batch_size": 1, "grad_accum": 4, "dp": 1},
     "ranks": [{"rank": 0, "stage": 0, "layers": [0, 1], "params_local": ...,
                "param_bytes_local": ..., "trainable_params_local": ...,
                "reference_params_local": 0, "reference_param_bytes_local": 0,
                "allocated_bytes": ..., "peak_bytes": ...}, ...],
     "plan": {"ranks": [{"rank": 0, "stage": 0, "total_bytes": ..., "items": {...}}, ...],
              "budget_bytes": null, "fits": true, "device": "cpu", "peak_rank": 0,
              "peak_bytes": ..., "moments": {"0": "backward: layer", ...}, ...},
     "data": {"source": ..., "rows": ..., "bad_records": {...}}}

`global_batch` is what one optimizer step consumes, the whole job (`Trainer.global_batch`:
micro_batch_size × grad_accum × dp sequences of seq_len tokens). `params_local` /
`param_bytes_local` count the parameters this rank materialised for the
trained module (its pipeline stage — under parallel.ep with its share of the routed experts —
LoRA adapters included); a frozen DPO reference copy is
counted apart (`reference_*`). `allocated_bytes` is the allocator's count of live Paddle tensors
after the build and `peak_bytes` its peak so far (`flashcp.metrics.memory`): a rank that built
more than its stage, even briefly, shows it there. `plan` is the memory planner's prediction for the
config on the run's device (`plan_summary`, `flashcp.plan`): per rank the planned bytes at its
peak, item by item, against `hardware.memory_gib`. `data` is what the recipe's data
read (`data_report`): rows, usable documents, tokens, and the bad records it skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from flashcp.distributed import all_gather_object
from flashcp.metrics import memory

RUN_INFO_FILE = "run_info.json"


def parameter_totals(module: paddle.nn.Layer | None) -> tuple[int, int]:
    """(number of parameter elements, their bytes) of `module` (0, 0 for None)."""
    if module is None:
        return 0, 0
    count = nbytes = 0
    for p in module.parameters():
        n = int(np.prod(p.shape)) if len(p.shape) else 1
        count += n
        nbytes += n * int(p.element_size())
    return count, nbytes


def rank_record(trainer: Any) -> dict[str, Any]:
    """This rank's entry of `run_info.json`."""
    params, nbytes = parameter_totals(trainer.model)
    ref_params, ref_bytes = parameter_totals(getattr(trainer.recipe, "reference", None))
    r = trainer.spec.layers
    return {
        "rank": trainer.rank,
        "stage": trainer.pp_rank,
        "layers": [r.start, r.stop],
        "params_local": params,
        "param_bytes_local": nbytes,
        "trainable_params_local": sum(int(np.prod(p.shape)) for _, p in trainer.params),
        "reference_params_local": ref_params,
        "reference_param_bytes_local": ref_bytes,
        "allocated_bytes": memory.allocated_bytes(),
        "peak_bytes": memory.peak_bytes(),
    }


def plan_summary(cfg: Any, device: str | None = None) -> dict[str, Any]:
    """The memory plan of `cfg` on `device` (`flashcp.plan`, what `flashcp plan --json`
    prints: every rank's planned bytes item by item, the budget and whether it fits), plus the
    device and dtypes it assumed, each stage's peak moment, and the largest rank — to compare
    with the measured `peak_bytes` of the rank records and metrics.jsonl."""
    from flashcp.plan import plan

    p = plan(cfg, device=device)
    peak = p.peak
    return {
        **p.to_json(),
        "device": p.device,
        "compute_dtype": p.compute_dtype,
        "param_dtype": p.param_dtype,
        "moments": {str(r.stage): r.moment for r in p.stages()},
        "peak_rank": peak.rank,
        "peak_bytes": peak.total_bytes,
        "notes": list(p.notes),
    }


def run_info(cfg: Any, trainer: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The `run_info.json` document from every rank's `rank_record`."""
    return {
        "world": int(trainer.groups.world.nranks),
        "degrees": {
            "dp": trainer.dp_size,
            "pp": trainer.pp_size,
            "cp": trainer.cp_size,
            "ep": getattr(trainer, "ep_size", 1),
        },
        "device": trainer.device,
        "param_dtype": cfg.train.param_dtype,
        "compute_dtype": trainer.dtype,
        "global_batch": trainer.global_batch(),
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "plan": plan_summary(cfg, trainer.device),
        "data": data_report(trainer),
    }


def data_report(trainer: Any) -> dict[str, Any] | None:
    """The recipe data's `data_report()`: source, rows, usable documents/pairs, tokens and the
    bad records skipped (by reason, with their first rows); None if the data has none."""
    report = getattr(getattr(trainer, "data", None), "data_report", None)
    return report() if callable(report) else None


def write_run_info(trainer: Any) -> Path | None:
    """Gather every rank's record (collective over the world) and write `run_info.json` on
    rank 0; returns its path there (None elsewhere)."""
    ranks = all_gather_object(rank_record(trainer), trainer.groups.world)
    if not trainer.is_main:
        return None
    path = trainer.output_dir / RUN_INFO_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(run_info(trainer.cfg, trainer, ranks), indent=2) + "\n")
    os.replace(tmp, path)
    return path
