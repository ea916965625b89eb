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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TOLERANCE = 0.15
GPU_CONFIGS = (
    "configs/glm/glm4_9b_cp8.yaml",
    "configs/glm/glm4_9b_dpo_lora_pp2_cp4.yaml",
    "configs/glm/glm45_air_cp8.yaml",
    "configs/glm/glm45_air_dpo_lora_pp_cp.yaml",
    "configs/glm/glm45_air_dpo_lora_ep.yaml",
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
    import flashcp.models
    from flashcp.config import load_config
    from flashcp.trainer import Trainer

    # Real-width layers at reduced depth exceed the CPU build guard meant for whole real models.
    flashcp.models.CPU_MAX_PARAMETERS = 10**12
    cfg = load_config(config, allow_placeholders=True)
    groups = None
    if cfg.parallel.world_size > 1:
        from flashcp.distributed import ParallelDims, build_groups, init_distributed

        env = init_distributed()
        p = cfg.parallel
        dims = ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size, ep=p.ep)
        groups = build_groups(dims)
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
    trainer.fit()
    record = {
        "rank": int(trainer.rank),
        "stage": int(trainer.pp_rank),
        "start_bytes": start,
        "build_peak_bytes": build_peak,
        "after_build_bytes": after_build,
        "train_peak_bytes": max(steps) if steps else 0,
        "step_peak_bytes": steps,
        "peak_bytes": max([build_peak, *steps]),
        "seconds": time.perf_counter() - t0,
    }
    (out_dir / RANK_FILE.format(rank=trainer.rank)).write_text(json.dumps(record))
    if groups is not None:
        from flashcp.distributed import shutdown

        shutdown()
    return 0


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
        env = dict(os.environ, OMP_NUM_THREADS="1", FLASHCP_PROGRESS="0", PYTHONUNBUFFERED="1")
        for key in [k for k in env if k.startswith(("PADDLE_TRAINER", "PADDLE_MASTER"))]:
            del env[key]
        me = [sys.executable, str(Path(__file__).resolve())]
        args = ["--worker", str(config), "--worker-out", str(out)]
        if world == 1:
            cmd = [*me, *args]
        else:
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
                   str(world), "--log_dir", str(out / "logs"), *me[1:], *args]  # fmt: skip
        from flashcp.distributed import ports

        t0 = time.perf_counter()
        with ports.reserve(world + 2) as lease:  # the launcher's ports, see flashcp's ports.py
            proc = subprocess.Popen(
                cmd, env={**env, **lease.env()}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT,
            )  # fmt: skip
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                record["error"] = f"timed out after {timeout:.0f} s"
                return record
        record["seconds"] = round(time.perf_counter() - t0, 1)
        ranks = []
        for r in range(world):
            path = out / RANK_FILE.format(rank=r)
            if not path.is_file():
                logs = out / "logs" / f"workerlog.{r}"
                tail = logs.read_text()[-3000:] if logs.is_file() else output[-3000:]
                record["error"] = f"rank {r} wrote no measurement (exit {proc.returncode}):\n{tail}"
                return record
            m = json.loads(path.read_text())
            predicted = p.ranks[r].total_bytes
            m["predicted_bytes"] = predicted
            m["ratio"] = m["peak_bytes"] / predicted if predicted else float("nan")
            ranks.append(m)
        record["ranks"] = ranks
        record["within"] = all(abs(m["ratio"] - 1) <= TOLERANCE for m in ranks)
        return record


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
            "stages": stages,
            "fit_options": [o.to_json() for o in options],
        })  # fmt: skip
    return out


# -- report -------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _yaml(v: Any) -> str:
    """A config value as YAML writes it (true, 96, bfloat16)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def markdown(data: dict[str, Any]) -> str:
    from flashcp.plan import ITEM_DOCS

    lines = [
        "# Memory: the planner against the allocator",
        "",
        "`flashcp plan CONFIG` predicts every rank's peak memory before launch "
        "(`flashcp.plan`); `flashcp validate` refuses a config whose plan exceeds "
        "`hardware.memory_gib`. `scripts/memory_check.py` trains configs for a few steps and "
        "measures each rank's peak with Paddle's allocator statistics "
        '(`host_memory_stat_peak_value("Allocated", 0)` on CPU: exact bytes of Paddle '
        "tensors), build included. Raw numbers: [`memory.json`](memory.json).",
        "",
        "## Predicted vs measured (CPU, float32)",
        "",
        "| case | world | rank (stage) | predicted GiB | measured GiB | measured / predicted "
        "| peak moment (plan) |",
        "|---|---|---|---|---|---|---|",
    ]
    passed = 0
    for case in data["cases"]:
        if "ranks" not in case:
            why = case.get("skipped") or case.get("error", "").splitlines()[0]
            lines.append(f"| {case['name']} | {case['world']} | — | — | — | not run: {why} | |")
            continue
        passed += bool(case["within"])
        seen = set()
        for m in case["ranks"]:
            key = (m["stage"], round(m["ratio"], 2))
            if key in seen:
                continue  # ranks of a stage measure alike; show each distinct one once
            seen.add(key)
            same = [x["rank"] for x in case["ranks"] if x["stage"] == m["stage"]]
            where = f"{m['rank']} ({m['stage']})" + (f" of {same}" if len(same) > 1 else "")
            lines.append(
                f"| {case['name']} | {case['world']} | {where} | {_gib(m['predicted_bytes'])} | "
                f"{_gib(m['peak_bytes'])} | {m['ratio']:.3f} | "
                f"{case['moments'].get(str(m['stage']), '')} |"
            )
    run = [c for c in data["cases"] if "ranks" in c]
    lines += [
        "",
        f"**{passed} of {len(run)} measured configs have every rank within ±15 %** "
        f"({len(data['cases'])} cases listed).",
        "",
        "Cases:",
        "",
    ]
    for case in data["cases"]:
        ov = " ".join(case["overrides"])
        drop = f" (sections dropped: {', '.join(case['drop'])})" if case.get("drop") else ""
        steps = f"{case.get('steps', data['steps'])} steps"
        commit = f", commit {case['commit']}" if case.get("commit") else ""
        lines.append(
            f"* `{case['name']}`: {case['note']} — `{case['config']}` `{ov}`{drop} "
            f"({steps}{commit})"
        )
    lines += [
        "",
        "## What the plan counts",
        "",
        "Items are the bytes live at the rank's peak moment (they sum to the total); see "
        "`flashcp.plan.model` for the moments and `flashcp.plan.activations` for the "
        "per-layer formulas.",
        "",
        "| item | counts |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {v} |" for k, v in ITEM_DOCS.items()]
    lines += [
        "",
        "What the CPU comparison does not check: the bf16 sizes (Paddle's O1 autocast copies of "
        "matmul inputs and float32 weights, bf16 matmul outputs) and the GPU-only terms "
        "(FlashAttention's backward workspace, `fixed_overhead`: 2 GiB of CUDA context, "
        "cuBLAS/NCCL buffers plus 5 % allocator slack) follow the code and Paddle's AMP lists "
        "but were not measured on a GPU; on CPU the routed experts' buffer is padded per "
        "group of experts (`flashcp.models.experts`), and the plan assumes the loads of a "
        "uniform router — a skewed one (e.g. freshly initialised, 4 experts) pads more, which "
        "is where the tiny MoE case's few percent come from (on GPU the buffer is ragged, "
        "T·k rows whatever the skew); the CPU attention kernel's numpy scratch (bounded by "
        "heads × 128 × 1024 floats) is outside Paddle's allocator.",
        "",
        "Real-width rehearsal (`tests/integration/test_real_width_rehearsal.py`, in CI): the "
        "last pipeline stage of GLM-4.5-Air at its real width — a dense layer, an MoE layer "
        "of 128 experts, the 151,552-column head, ~3.2B parameters — built alone in bf16, "
        "filled through `checkpoint.init_from` from a synthetic sharded HF checkpoint of the "
        "whole model (reading exactly its share), then one LoRA DPO micro-batch forward and "
        "backward: the allocator's peak must stay within 15 % of this plan.",
        "",
        "## The shipped GPU configs on H20 (96 GiB per GPU)",
        "",
    ]
    lines.append(
        "`flashcp plan CONFIG` of each shipped GPU config (`run.device: gpu`, bf16 compute) "
        "against the 96 GiB of an H20 (`hardware.memory_gib: 96` in each file; "
        "`flashcp validate` refuses a config that does not fit): each rank builds only its "
        "pipeline stage, in `train.param_dtype`. Per stage (its ranks hold equal bytes):"
    )
    lines.append("")
    for g in data["gpu_plans"]:
        verdict = "fits" if g["fits"] else "**does not fit**"
        nodes = g.get("nodes", -(-g["world"] // GPUS_PER_NODE))
        peak = g.get("peak_bytes", max(s["total_bytes"] for s in g["stages"]))
        settings = ", ".join(f"`{k}: {_yaml(v)}`" for k, v in g.get("settings", {}).items())
        lines += [
            f"### `{g['config']}` — {g['world']} GPUs ({nodes} node{'s' if nodes > 1 else ''} "
            f"of 8), seq_len {g['seq_len']}: {verdict}, planned peak {_gib(peak)} GiB per rank",
            "",
        ]
        if settings:
            lines += [f"{g.get('layout', '')}; {settings}.", ""]
        lines += [
            "| stage | ranks | layers | peak GiB | at | largest items (GiB) |",
            "|---|---|---|---|---|---|",
        ]
        for s in g["stages"]:
            top = sorted(s["items"].items(), key=lambda kv: -kv[1])[:4]
            items = ", ".join(f"{k} {_gib(v)}" for k, v in top if v)
            ranks = s["ranks"]
            span = f"{ranks[0]}–{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
            lines.append(
                f"| {s['stage']} | {span} | {s['layers'][0]}–{s['layers'][1] - 1} | "
                f"{_gib(s['total_bytes'])} | {s['moment']} | {items} |"
            )
        if g["fit_options"]:
            lines += ["", "Changes that fit 96 GiB (planned peak of the largest rank):", ""]
            for o in g["fit_options"]:
                lines.append(
                    f"* `{' '.join(o['overrides'])}` → {_gib(o['peak_bytes'])} GiB, "
                    f"{o['world']} GPUs ({o['nodes']} node(s) of 8)"
                )
        lines.append("")
    env = data["environment"]
    lines += [
        f"Environment: paddlepaddle {env['paddle']}, Python {env['python']}, "
        f"{env['cpus']} CPUs, OMP_NUM_THREADS=1 per rank, {data['date']}.",
        "",
        "Reproduce: `python scripts/memory_check.py` (cases in `scripts/memory_cases.yaml`).",
        "",
    ]
    return "\n".join(lines)


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
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "memory.json")
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs" / "memory.md")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="no runs: re-plan the measured cases with the current planner, rewrite the report",
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
        data = json.loads(args.json.read_text())
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
                print(
                    f"   rank {m['rank']} (stage {m['stage']}): predicted "
                    f"{_gib(m['predicted_bytes'])} GiB, measured {_gib(m['peak_bytes'])} GiB "
                    f"(build {_gib(m['build_peak_bytes'])}, train "
                    f"{_gib(m['train_peak_bytes'])}), ratio {m['ratio']:.3f}",
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
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    args.markdown.write_text(markdown(data))
    print(f"wrote {args.json} and {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
