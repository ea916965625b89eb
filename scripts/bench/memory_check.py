"""Planner vs reality: train configs for a few steps, measure every rank's peak, compare.

For each case of `--cases` (default `scripts/memory_cases.yaml`: a config, overrides, a
note) the script resolves the config, asks `flashcp.plan` for every rank's planned peak, then
trains it for `--steps` steps: one process runs this script's worker directly, more run it
under `paddle.distributed.launch` (a real multi-process job, the trainer `flashcp train` runs).
Each rank measures its peak with Paddle's allocator statistics (CPU:
`paddle.base.core.host_memory_stat_peak_value("Allocated", 0)`, exact bytes of Paddle tensors;
GPU: `paddle.device.cuda.max_memory_allocated()`): the peak while building the Trainer (model,
optimizer, data), then, after a reset, the peak over the training steps. The measured peak of
the run is the larger of the two (build included). The table gives predicted vs measured per
rank and their ratio; a case passes when every rank is within ±15 %.

Cases whose plan exceeds the memory this machine has free (`--max-gib`, default 80 % of
MemAvailable) are skipped and listed as such. The shipped GPU configs are planned (not
run) against the 96 GiB of an H20, with the changes that would make each fit.

Writes `--json` (default docs/memory.json) and `--markdown` (default docs/memory.md).

Usage:
    python scripts/memory_check.py                       # every case, then the report
    python scripts/memory_check.py --only gpt_tiny glm_tiny_cp2
    python scripts/memory_check.py --report-only         # re-plan the measured cases, rewrite
    python scripts/memory_check.py --update --only NAME  # run NAME, keep the other records
    python scripts/memory_check.py --cases my_cases.yaml --json /tmp/m.json --markdown /tmp/m.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import DOCS, ROOT, Page

ENTRY = ROOT / "scripts" / "memory_check.py"
"""The command line this module runs behind; each case's ranks run it again (`--worker`)."""
GIB = 2**30
TOLERANCE = 0.15
GPU_CONFIGS = (
    "configs/glm/glm4_9b_cp8.yaml",
    "configs/glm/glm4_9b_dpo_lora_pp2_cp4.yaml",
    "configs/glm/glm45_air_cp8.yaml",
    "configs/glm/glm45_air_dpo_lora_pp_cp.yaml",
    "configs/glm/glm45_air_dpo_lora_ep.yaml",
    "configs/glm/glm4_9b_dpo_lora_4m_cp8.yaml",
    "configs/glm/glm4_9b_sft_4m_cp8.yaml",
    "configs/glm/glm45_air_sft_ep8_pp4_cp8.yaml",
    "configs/llama/llama31_8b_sft_256k_cp8.yaml",
    "configs/qwen/qwen3_8b_sft_256k_cp8.yaml",
    "configs/qwen/qwen3_30b_a3b_dpo_lora_ep.yaml",
    "configs/ernie/ernie45_21b_a3b_sft_128k_cp8.yaml",
    "configs/ernie/ernie45_21b_a3b_dpo_lora_128k_cp8.yaml",
)
H20_GIB = 96.0
GPUS_PER_NODE = 8
RANK_FILE = "memory.rank{rank}.json"


# -- measurement (runs inside each rank) --------------------------------------------------------


def allocator() -> tuple[Any, Any, Any]:
    """(current, peak, reset_peak) of this process's Paddle allocator, in bytes."""
    import paddle

    if paddle.is_compiled_with_cuda() and "gpu" in str(paddle.get_device()):
        cuda = paddle.device.cuda
        return cuda.memory_allocated, cuda.max_memory_allocated, cuda.reset_max_memory_allocated
    core = paddle.base.core
    return (
        lambda: core.host_memory_stat_current_value("Allocated", 0),
        lambda: core.host_memory_stat_peak_value("Allocated", 0),
        lambda: core.host_memory_stat_reset_peak_value("Allocated", 0),
    )


def worker(config: Path, out_dir: Path) -> int:
    """Train `config` on this rank and write its allocator peaks to `out_dir`."""
    import flashcp.models.build
    from flashcp.config import load_config
    from flashcp.launch.worker import set_runtime_flags
    from flashcp.trainer import Trainer

    # Real-width layers at reduced depth exceed the CPU build guard meant for whole real models.
    flashcp.models.build.CPU_MAX_PARAMETERS = 10**12
    cfg = load_config(config, allow_placeholders=True)
    groups = None
    if cfg.parallel.world_size > 1:
        from flashcp.distributed import ParallelDims, build_groups, init_distributed

        env = init_distributed()
        p = cfg.parallel
        dims = ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size, ep=p.ep)
        groups = build_groups(dims)
    set_runtime_flags(cfg)  # as a launched rank does (the Trainer sets no flag)
    current, peak, reset = allocator()
    start = int(current())
    reset()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, groups, stream=open(os.devnull, "w"))  # noqa: SIM115
    build_peak, after_build = int(peak()), int(current())
    reset()
    steps: list[int] = []
    original = trainer.train_step

    def measured_step() -> Any:
        m = original()
        steps.append(int(peak()))
        return m

    trainer.train_step = measured_step  # type: ignore[method-assign]
    host_peaks = _count_host_copies()
    trainer.fit()
    record = {
        "rank": int(trainer.groups.rank),
        "stage": int(trainer.groups.pp.rank),
        "start_bytes": start,
        "build_peak_bytes": build_peak,
        "after_build_bytes": after_build,
        "train_peak_bytes": max(steps) if steps else 0,
        "step_peak_bytes": steps,
        "peak_bytes": max([build_peak, *steps]),
        "host_peak_bytes": max(host_peaks, default=0),
        "seconds": time.perf_counter() - t0,
    }
    (out_dir / RANK_FILE.format(rank=record["rank"])).write_text(json.dumps(record))
    if groups is not None:
        from flashcp.distributed import shutdown

        shutdown()
    return 0


def _count_host_copies() -> list[int]:
    """This rank's activation-offload host bytes at their peak, per step, as the trainer takes
    them (`flashcp.models.offload.take_host_peak`: counted at the copies, numpy buffers outside
    the allocator; the step metric is their maximum over the ranks). Stays empty without an
    offload (the trainer takes none)."""
    import flashcp.trainer as trainer_module

    peaks: list[int] = []
    take = trainer_module.take_host_peak

    def counted() -> int:
        peaks.append(take())
        return peaks[-1]

    trainer_module.take_host_peak = counted  # type: ignore[attr-defined]
    return peaks


# -- driving the cases --------------------------------------------------------------------------


def load_cases(path: Path) -> list[dict[str, Any]]:
    import yaml

    cases = yaml.safe_load(path.read_text()) or []
    for case in cases:
        for key in ("name", "config"):
            if key not in case:
                raise SystemExit(f"{path}: a case lacks {key!r}: {case}")
    return cases


def resolve(case: dict[str, Any], out_dir: Path, steps: int) -> Any:
    """The case's `Config`: the file, minus `drop` sections and unfilled `/path/to/`
    placeholders (the model comes from the restated shape keys, the data from the built-in
    corpus: memory does not depend on the text), plus overrides and run settings."""
    from flashcp.config import build_config, read_yaml
    from flashcp.config.placeholders import find_placeholders

    raw = read_yaml(ROOT / case["config"])
    for section in case.get("drop", []):
        raw.pop(section, None)
    for key, _ in find_placeholders(raw):
        section, name = key.split(".", 1)
        raw[section].pop(name)
    overrides = [
        *case.get("overrides", []),
        f"run.output_dir={out_dir / 'run'}",
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.log_every=1000",
        "checkpoint.every=0",
        "checkpoint.resume=never",
        "run.overwrite=true",
    ]
    return build_config(raw, source=case["config"], overrides=overrides)


def _commit() -> str:
    """The checked-out commit (the code that was measured), or '' outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return ""
    return out.stdout.strip()


def _available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def run_case(case: dict[str, Any], steps: int, timeout: float, max_gib: float) -> dict[str, Any]:
    """Plan and (if it fits here) train one case; the result record."""
    from flashcp.config import to_yaml
    from flashcp.launch import supervise
    from flashcp.plan import plan

    with tempfile.TemporaryDirectory(prefix=f"memcheck-{case['name']}-") as tmp:
        out = Path(tmp)
        steps = int(case.get("steps", steps))
        cfg = resolve(case, out, steps)
        p = plan(cfg, device="cpu")
        world = cfg.parallel.world_size
        record: dict[str, Any] = {
            "name": case["name"],
            "config": case["config"],
            "overrides": list(case.get("overrides", [])),
            "drop": list(case.get("drop", [])),
            "note": case.get("note", ""),
            "world": world,
            "steps": steps,
            "commit": _commit(),
            "plan": p.to_json(),
            "moments": {str(r.stage): r.moment for r in p.stages()},
        }
        need = sum(r.total_bytes for r in p.ranks) / GIB
        if need > max_gib:
            record["skipped"] = (
                f"needs ~{need:.1f} GiB over {world} rank(s), {max_gib:.1f} GiB usable here"
            )
            return record
        config = out / "config.yaml"
        config.write_text(to_yaml(cfg))
        env = supervise.job_env(
            uuid.uuid4().hex, extra={"OMP_NUM_THREADS": "1", "FLASHCP_PROGRESS": "0"}
        )
        me = [sys.executable, str(ENTRY)]
        args = ["--worker", str(config), "--worker-out", str(out)]
        if world == 1:
            cmd = [*me, *args]
        else:
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
                   str(world), "--log_dir", str(out / "logs"), *me[1:], *args]  # fmt: skip
        from flashcp.distributed import ports

        t0 = time.perf_counter()
        with ports.reserve(world + 2) as lease:  # the launcher's ports, see flashcp's ports.py
            job = supervise.Job.start(
                cmd, {**env, **lease.env()}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            )  # fmt: skip
            code, timed_out, output = job.wait(timeout)  # the whole job is killed on timeout
            if timed_out:
                record["error"] = f"timed out after {timeout:.0f} s"
                return record
        record["seconds"] = round(time.perf_counter() - t0, 1)
        ranks = []
        for r in range(world):
            path = out / RANK_FILE.format(rank=r)
            if not path.is_file():
                logs = out / "logs" / f"workerlog.{r}"
                tail = logs.read_text()[-3000:] if logs.is_file() else output[-3000:]
                record["error"] = f"rank {r} wrote no measurement (exit {code}):\n{tail}"
                return record
            m = json.loads(path.read_text())
            predicted = p.ranks[r].total_bytes
            m["predicted_bytes"] = predicted
            m["ratio"] = m["peak_bytes"] / predicted if predicted else float("nan")
            _host(m, p, r)
            ranks.append(m)
        record["ranks"] = ranks
        record["within"] = all(abs(m["ratio"] - 1) <= TOLERANCE for m in ranks)
        return record


def _host(m: dict[str, Any], p: Any, rank: int) -> None:
    """The planned host bytes of `rank` that the offload's counters measure (its stash of
    layer inputs; on CPU nothing else of the host plan is in them), beside the measured."""
    if p.host is None:
        return
    planned = p.host.ranks[rank].moments["training step"]["offloaded_activations"]
    m["predicted_host_bytes"] = planned
    if planned or m.get("host_peak_bytes"):
        m["host_ratio"] = m.get("host_peak_bytes", 0) / planned if planned else float("inf")


def replan(case: dict[str, Any]) -> None:
    """Refresh a measured case's prediction with the current planner (measurements stay)."""
    from flashcp.plan import plan

    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve(case, Path(tmp), int(case.get("steps", 3)))
    p = plan(cfg, device="cpu")
    case["plan"] = p.to_json()
    case["moments"] = {str(r.stage): r.moment for r in p.stages()}
    for m in case.get("ranks", []):
        m["predicted_bytes"] = p.ranks[m["rank"]].total_bytes
        m["ratio"] = m["peak_bytes"] / m["predicted_bytes"]
        _host(m, p, m["rank"])
    if "ranks" in case:
        case["within"] = all(abs(m["ratio"] - 1) <= TOLERANCE for m in case["ranks"])


def gpu_plans() -> list[dict[str, Any]]:
    """The shipped GPU configs planned against an H20 (96 GiB), with what would fit."""
    from flashcp.config import load_config
    from flashcp.models import estimate_parameters
    from flashcp.plan import plan
    from flashcp.plan.report import fit_options

    out = []
    for path in GPU_CONFIGS:
        cfg = load_config(ROOT / path, allow_placeholders=True)
        p = plan(cfg, budget_gib=H20_GIB)
        stages = []
        for r in p.stages():
            stages.append({
                "stage": r.stage,
                "ranks": [x.rank for x in p.ranks if x.stage == r.stage],
                "layers": [r.layers.start, r.layers.stop],
                # the last stage's multi-token-prediction layers (flashcp.models.mtp)
                "mtp_layers": cfg.model.mtp_layers if r.stage == cfg.parallel.pp - 1 else 0,
                "total_bytes": r.total_bytes,
                "moment": r.moment,
                "items": r.items,
            })  # fmt: skip
        options = [] if p.fits else fit_options(cfg, budget_gib=H20_GIB)
        par, train = cfg.parallel, cfg.train
        out.append({
            "config": path,
            "params": estimate_parameters(cfg.model),
            "recipe": cfg.run.recipe + (" + LoRA" if cfg.extras.get("lora") else ""),
            "world": cfg.parallel.world_size,
            "nodes": -(-cfg.parallel.world_size // GPUS_PER_NODE),
            "layout": f"dp {par.dp} × pp {par.pp} × cp {par.cp}"
            + (f" (ep {par.ep})" if par.ep > 1 else ""),
            "settings": {
                "train.param_dtype": train.param_dtype,
                "parallel.shard_optimizer": par.shard_optimizer,
                "train.loss_chunk_tokens": train.loss_chunk_tokens,
                "model.recompute": cfg.model.recompute,
                "hardware.memory_gib": cfg.hardware.memory_gib,
            },
            "seq_len": cfg.data.seq_len,
            "fits": p.fits,
            "peak_bytes": p.peak.total_bytes,
            "budget_bytes": p.budget_bytes,
            "usable_bytes": p.usable_bytes,
            "stages": stages,
            "fit_options": [o.to_json() for o in options],
        })  # fmt: skip
    return out


# -- a published run beside the plan -------------------------------------------------------------

TORCHTITAN = {
    "source": "pytorch/torchtitan docs/performance.md, Table 2 (FSDP + CP + torch.compile + "
    "Float8; the page was replaced by benchmarks/ in commit 820504e2, 2025-06-13; its versions "
    "table: torch 1963fc8, torchao eab345c, torchtitan 9dec370, December 2024)",
    "model": "Llama-3.1-8B",
    "gpus": 8,
    "seq_len": 262144,
    "memory_gib": 84.5,
    "tokens_per_s_per_gpu": 548,
    "hardware": "8 × H100 with 96 GB HBM2e each (Grand Teton, 500 W power limit)",
    "peak_tflops": 989.0,
    "memory_metric": "max reserved memory of PyTorch's caching allocator "
    "(`reserved_bytes.all.peak`, torchtitan/metrics.py at 9dec370), read at iteration 90",
}
"""torchtitan's published Llama-3.1-8B CP 8 row (a run), and what its memory figure measures."""
LLAMA_RECIPE = "configs/llama/llama31_8b_sft_256k_cp8.yaml"
"""The shipped Llama-3.1-8B recipe at torchtitan's row's length (CP 8, 262,144 tokens): the
plan starts from it, the settings below moved to torchtitan's."""
TORCHTITAN_CLOSEST = (
    "parallel.dp=1", "parallel.pp=1", "parallel.cp=8", "data.seq_len=262144",
    "data.micro_batch_size=1", "train.grad_accum=1", "model.recompute=full",
    "train.param_dtype=bfloat16", "parallel.shard_optimizer=true",
    "parallel.shard_gradients=true", "train.loss_chunk_tokens=0", "hardware.peak_tflops=989",
)  # fmt: skip
"""flashcp's closest settings to torchtitan's row: CP 8 over the node, one 262,144-token
sequence per step, full recompute, ZeRO-2 (FSDP shards the parameters too: ZeRO-3, which
flashcp does not have), the loss over the whole logits (torchtitan's `cross_entropy` on
`pred.float()`)."""
TORCHTITAN_DIFFERENCES = (
    ("model", "Llama-3.1-8B (torchtitan's llama3 8B flavour)", "Llama-3.1-8B (flashcp's llama "
     "family, transformers' LlamaForCausalLM exactly, llama3 RoPE scaling): the shipped "
     f"{LLAMA_RECIPE}; 8.03B parameters"),
    ("parameters", "FSDP2 over the 8 ranks (dp_shard × cp mesh): float32 parameters, "
     "gradients and AdamW state all sharded (ZeRO-3); bf16 copies of one layer gathered "
     "at a time", "bf16 parameters whole on every rank (15 GiB); float32 gradients, masters "
     "and moments sharded over the 8 ranks (ZeRO-2)"),
    ("matmuls", "Float8 (torchao) for the linear layers, torch.compile per block",
     "bf16 (Paddle O1 autocast), eager"),
    ("attention", "PyTorch context_parallel: SDPA ring attention, K/V all-gathered "
     "(rotate allgather), head-tail load balance", "FlashMask all-gather-KV, dual-chunk "
     "balance (the same chunks), the GPU kernels' own buffers planned"),
    ("activations", "full activation checkpointing", "model.recompute: full"),
    ("loss", "cross-entropy over the whole float32 logits", "train.loss_chunk_tokens: 0 (the "
     "closest); chunks of 2,048 tokens shown as well"),
    ("memory figure", "max reserved by the caching allocator (allocated plus its cached "
     "free blocks; no CUDA context, no NCCL buffers)", "planned peak: tensors plus 5 % "
     "allocator slack, 1 GiB CUDA context and the NCCL communicators"),
    ("hardware", "H100, 96 GB HBM2e, 500 W", "planned for 8 × 80 GB (the common H100) and "
     "for torchtitan's 96 GB, each less the 5 % headroom"),
)  # fmt: skip
"""(setting, torchtitan, flashcp) — every difference between the two rows."""


def torchtitan_check() -> dict[str, Any]:
    """flashcp's plan and step-time estimate of a Llama-3.1-8B-shaped model at torchtitan's
    row's settings (`TORCHTITAN_CLOSEST`), beside the published figures."""
    from flashcp.config import load_config
    from flashcp.metrics.flops import causal_keys, flops_per_token
    from flashcp.models import estimate_parameters
    from flashcp.plan import GIB, plan
    from flashcp.plan.steptime import DEFAULT_MFU, estimate

    t = TORCHTITAN
    rows = []
    variants = (("closest", ()), ("loss chunks of 2,048", ("train.loss_chunk_tokens=2048",)))
    for name, extra in variants:
        cfg = load_config(ROOT / LLAMA_RECIPE, [*TORCHTITAN_CLOSEST, *extra],
                          allow_placeholders=True)  # fmt: skip
        fits = {}
        for gb in (80, 96):
            p = plan(cfg, budget_gib=gb * 1e9 / GIB)
            fits[str(gb)] = {"fits": p.fits, "usable_gib": (p.usable_bytes or 0) / GIB}
        peak = p.peak
        est = estimate(cfg, mfu=DEFAULT_MFU)
        assert est.seconds is not None
        rows.append({
            "name": name,
            "overrides": list(extra),
            "peak_gib": peak.total_bytes / GIB,
            "tensor_gib": (peak.total_bytes - peak.items["fixed_overhead"]
                           - peak.items["nccl_communicators"]) / GIB,
            "moment": peak.moment,
            "items_gib": {k: v / GIB for k, v in peak.items.items() if v},
            "fits": fits,
            "step_seconds": est.seconds,
            "tokens_per_s_per_gpu": t["seq_len"] / est.seconds / t["gpus"],
            "hfu": est.hfu,
        })  # fmt: skip
    per_token = flops_per_token(cfg.model, t["seq_len"], keys=causal_keys(t["seq_len"]))
    full = flops_per_token(cfg.model, t["seq_len"])
    return {
        **t,
        "params": estimate_parameters(cfg.model),
        "recipe": LLAMA_RECIPE,
        "overrides": list(TORCHTITAN_CLOSEST),
        "differences": [list(d) for d in TORCHTITAN_DIFFERENCES],
        "mfu": DEFAULT_MFU,
        "rows": rows,
        # the MFU the published throughput is, counted as flashcp counts (causal pairs) and
        # as torchtitan counts (every key: 12·L·H·d·S per token)
        "published_mfu_causal": t["tokens_per_s_per_gpu"] * per_token / (t["peak_tflops"] * 1e12),
        "published_mfu_full": t["tokens_per_s_per_gpu"] * full / (t["peak_tflops"] * 1e12),
    }


# -- report -------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def view(data: dict[str, Any]) -> dict[str, Any]:
    """The page's derived figures: each measured case's distinct rank rows, the plan's items."""
    from flashcp.plan import ITEM_DOCS
    from flashcp.plan.host import HOST_ITEM_DOCS

    shown: dict[str, list[tuple[dict[str, Any], list[int]]]] = {}
    for case in data["cases"]:
        seen: set[tuple[int, float]] = set()
        for m in case.get("ranks", []):
            key = (m["stage"], round(m["ratio"], 2))
            if key in seen:
                continue  # ranks of a stage measure alike; show each distinct one once
            seen.add(key)
            same = [x["rank"] for x in case["ranks"] if x["stage"] == m["stage"]]
            shown.setdefault(case["name"], []).append((m, same))
    return {
        "rank_rows": shown,
        "host_rows": [(c, m) for c in data["cases"] for m in c.get("ranks", [])
                      if "host_ratio" in m],  # fmt: skip
        "slopes": slopes(data["cases"]),
        "measured": [c for c in data["cases"] if "ranks" in c],
        "item_docs": ITEM_DOCS,
        "host_item_docs": HOST_ITEM_DOCS,
        "gib": GIB,
        "gpus_per_node": GPUS_PER_NODE,
    }


def slopes(cases: list[dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """(shorter case, longer case, measured, predicted bytes of rank 0's peak per token of the
    sequence) for consecutive cases named alike but for their length suffix (`_2k`, `_8k`)."""
    runs: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for case in cases:
        stem, _, length = case["name"].rpartition("_")
        if stem and length.endswith("k") and length[:-1].isdigit() and case.get("ranks"):
            runs.setdefault(stem, []).append((int(length[:-1]) * 1024, case))
    out = []
    for found in runs.values():
        found.sort(key=lambda x: x[0])
        for (n0, a), (n1, b) in zip(found, found[1:], strict=False):
            ra, rb = a["ranks"][0], b["ranks"][0]
            tokens = n1 - n0
            ms = (rb["peak_bytes"] - ra["peak_bytes"]) / tokens
            ps = (rb["predicted_bytes"] - ra["predicted_bytes"]) / tokens
            out.append((a["name"], b["name"], ms, ps))
    return out


PAGE = Page("memory.md.j2", DOCS / "memory.json", view=view, indent=1)
"""`docs/memory.md`, from `docs/memory.json` (the measured cases re-planned by `--report-only`)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=Path, default=ROOT / "scripts" / "memory_cases.yaml")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--steps", type=int, default=3, help="training steps per case")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    parser.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="skip cases planned above this (default 80%% of MemAvailable)",
    )
    PAGE.add_arguments(
        parser,
        report_only="no runs: re-plan the measured cases with the current planner, rewrite the "
        "record and the page",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the other cases of --json, replacing those run now (same name)",
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, args.worker_out)
    if args.report_only:
        data = PAGE.load(args)
    else:
        import paddle

        max_gib = args.max_gib if args.max_gib is not None else 0.8 * _available_gib()
        cases = load_cases(args.cases)
        if args.only:
            unknown = set(args.only) - {c["name"] for c in cases}
            if unknown:
                raise SystemExit(f"unknown case(s) {sorted(unknown)} in {args.cases}")
            cases = [c for c in cases if c["name"] in args.only]
        results = []
        for case in cases:
            print(f"== {case['name']}", flush=True)
            result = run_case(case, args.steps, args.timeout, max_gib)
            for m in result.get("ranks", []):
                host = ""
                if "host_ratio" in m:
                    host = (f"; host predicted {_gib(m['predicted_host_bytes'])} GiB, measured "
                            f"{_gib(m['host_peak_bytes'])} GiB, ratio {m['host_ratio']:.3f}")
                print(
                    f"   rank {m['rank']} (stage {m['stage']}): predicted "
                    f"{_gib(m['predicted_bytes'])} GiB, measured {_gib(m['peak_bytes'])} GiB "
                    f"(build {_gib(m['build_peak_bytes'])}, train "
                    f"{_gib(m['train_peak_bytes'])}), ratio {m['ratio']:.3f}{host}",
                    flush=True,
                )
            for key in ("skipped", "error"):
                if key in result:
                    print(f"   {key}: {result[key]}", flush=True)
            results.append(result)
        if args.update and args.json.is_file():
            # keep the other cases' measurements; new results replace same-named ones
            old = json.loads(args.json.read_text())["cases"]
            fresh = {r["name"]: r for r in results}
            names = [c["name"] for c in load_cases(args.cases)]
            merged = {c["name"]: c for c in old}
            merged.update(fresh)
            results = sorted(
                merged.values(),
                key=lambda c: names.index(c["name"]) if c["name"] in names else len(names),
            )
        data = {
            "date": datetime.date.today().isoformat(),
            "steps": args.steps,
            "tolerance": TOLERANCE,
            "environment": {
                "paddle": paddle.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "cases": results,
        }
    for case in data["cases"]:
        replan(case)
    data["gpu_plans"] = gpu_plans()
    data["torchtitan"] = torchtitan_check()
    PAGE.write(args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
