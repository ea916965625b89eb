"""The longest sequence per node and the fewest GPUs per model, by the memory plan: flashcp
before and after issue 20's mechanisms, beside ALST's published figures.

Nothing here is measured: each figure is `flashcp plan` (`flashcp.plan`, checked against the
allocator in `docs/memory.md`) of a shipped config on an 8×H20 node (96 GiB per GPU, the host
memory of `HARDWARE`), searched over:

* the longest `data.seq_len` (`flashcp.plan.longest`: both budgets) on ONE node, over the
  node's layouts (pp × cp = 8, and for MoE models every expert-parallel degree that divides
  cp), with today's features ("before": recompute, loss chunking, bf16 storage, ZeRO-1 as the
  config has them) and with the long-context mechanisms on through their config keys
  ("after": `AFTER`: activation offload, bf16 residual stream, sequence tiling, chunked
  attention, ZeRO-2 where the optimizer is sharded; each candidate validated like a config);
* the model-per-node side: the fewest GPUs on which GLM-4.5-Air's full fine-tune fits at its
  shipped 64K tokens, over pp × cp × ep layouts.

Every answer leaves the plan's margins free (`hardware.memory_headroom` of each GPU,
`hardware.host_memory_reserve` of the host) and also says what fits without them. Each carries
the plan's peaks, what stopped it (device or host budget, and the item), and a step-time
estimate at that length (`flashcp.plan.steptime`: executed FLOPs at the utilisation a stated
MFU implies, for one causal document per row and for rows packed from the long-tail mix of
`flashcp.data.mixes`).

The practical-lengths side: for each model row in its best "after" layout, the plan and the
step time at 128K … 4M tokens, and the lengths at which a step takes about one minute and
ten minutes. Writes `--json` (default
docs/long_context.json) and the page rendered from it alone (`--markdown`, default
docs/long_context.md); `--report-only` re-renders the page.

Usage:
    python scripts/bench_long_context.py
    python scripts/bench_long_context.py --report-only
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.report import DOCS, ROOT, Page

HARDWARE = {
    "memory_gib": 96.0,
    "host_memory_gib": 1769.0,
    "gpus_per_node": 8,
    "peak_tflops": 148.0,
    "host_link_gb_per_s": 32.0,
    "memory_headroom": 0.05,
    "host_memory_reserve": 0.1,
}
"""One 8×H20 node as the page plans it. 96 GiB HBM3 and 148 dense bf16 TFLOP/s per H20
(NVIDIA's H20 specification); host memory 1.9 TB (1769 GiB), what ALST's H100 nodes had, so
the comparison assumes the same host; host link 32 GB/s per GPU per direction: PCIe Gen5 x16
gives 63 GB/s, halved because on HGX-style boards two GPUs share a PCIe switch's uplink to
the CPU when all offload at once. The margins are the config defaults
(`flashcp.config.schema.HardwareConfig`), stated here so the page says what it assumed."""
MFU = 0.4
"""The model-FLOPs utilisation the step times assume (stated, not measured)."""
TARGET = 4_194_304
"""Issue 20's goal: GLM-4-9B at >= 4M tokens per sequence on one node."""

ROWS: tuple[dict[str, Any], ...] = (
    {
        "name": "GLM-4-9B full fine-tune (SFT)",
        "config": "configs/glm/glm4_9b_cp8.yaml",
        "overrides": [],
    },
    {
        "name": "GLM-4-9B LoRA-DPO",
        "config": "configs/glm/glm4_9b_dpo_lora_pp2_cp4.yaml",
        "overrides": [],
    },
    {
        "name": "GLM-4.5-Air LoRA-DPO (expert parallel)",
        "config": "configs/glm/glm45_air_dpo_lora_ep.yaml",
        "overrides": [],
    },
)
"""The longest-sequence rows: a shipped config each, its layout searched over one node."""

MODEL_PER_NODE = {
    "name": "GLM-4.5-Air full fine-tune (SFT, expert parallel)",
    "config": "configs/glm/glm45_air_cp8.yaml",
    "variant": "configs/glm/glm45_air_sft_ep8_pp4_cp8.yaml",
    "seq_len": 65536,
}
"""The fewest-GPUs row: the shipped 128-GPU config, re-laid out."""

ALST = {
    "model": "Llama-3.1-8B",
    "paper": "arXiv 2506.13996",
    "recipes": "github.com/snowflakedb/ArcticTraining, projects/sequence-parallelism: README.md "
    "(its environment) and run-sp1-llama-8b.yml, run-sp8-llama-8b.yml",
    "rows": [
        {"setup": "1 × H100 80GB", "gpus": 1, "seq_len": 500_000,
         "assumes": "ZeRO-3 with parameters AND optimizer states offloaded to host memory "
                    "(cpu_adam), activation checkpoints offloaded to host, tiled MLP and loss"},
        {"setup": "1 node, 8 × H100 80GB", "gpus": 8, "seq_len": 3_700_000,
         "assumes": "Ulysses SP 8, ZeRO-3 with optimizer states offloaded to host memory "
                    "(cpu_adam), activation checkpoints offloaded to host, tiled MLP and loss; "
                    "the recipe's max_length is 3,800,000"},
        {"setup": "4 nodes, 32 × H100 80GB", "gpus": 32, "seq_len": 15_000_000,
         "assumes": "Ulysses SP 32, as above"},
    ],  # fmt: skip
    "host_memory": "1.9 TB of CPU memory per 8×H100 node (the README's environment)",
}
"""ALST's published figures and what they assume (`--report-only` re-renders them)."""


def _after() -> tuple[str, ...]:
    from flashcp.plan.features import AFTER as FEATURES
    from flashcp.plan.features import as_overrides

    return tuple(o for o in as_overrides(FEATURES) if not o.startswith("parallel.shard_gradients"))


AFTER = _after()
"""The long-context mechanisms of the "after" column (`flashcp.plan.features.AFTER`), as config
overrides (ZeRO-2 added where the optimizer is sharded: `after_overrides`)."""
LENGTHS = (131072, 262144, 524288, 1048576, 2097152, 4194304)
"""The practical-lengths table's sequence lengths."""
STEP_TARGETS = (60.0, 600.0)
"""The step times (s) whose lengths the practical-lengths table gives."""
MIX = "long_tail"
"""The packed mix of the step times beside one document per row (`flashcp.plan.documents`)."""
PER_NODE_AFTER = (
    "train.offload_activations=true",
    "model.residual_dtype=bfloat16",
    "parallel.shard_gradients=true",
)
"""The mechanisms the fewest-GPUs row adds at 64K tokens: what shrinks the optimizer side and
the kept inputs (tiles and attention chunks matter at millions of tokens, not at 8K local)."""


def after_overrides(cfg: Any) -> list[str]:
    """`AFTER`, plus `parallel.shard_gradients=true` where the optimizer is sharded (ZeRO-2
    needs ZeRO-1; LoRA's few trained parameters are not sharded)."""
    return [*AFTER, *(["parallel.shard_gradients=true"] if cfg.parallel.shard_optimizer else [])]


def node_layouts(cfg: Any) -> list[list[str]]:
    """Overrides for every single-node layout of `cfg`: dp 1, pp × cp = gpus per node, pp at
    most the layers, grad_accum at least pp; for an MoE model every ep dividing cp (and the
    experts); the config's CP mode."""
    from flashcp.attention import registry as cp_modes

    per_node = int(HARDWARE["gpus_per_node"])
    chunks = cp_modes.get(cfg.parallel.cp_mode).chunks_per_rank
    out = []
    pp = 1
    while pp <= per_node:
        cp = per_node // pp
        if pp <= cfg.model.num_layers and per_node % pp == 0:
            base = [f"parallel.pp={pp}", f"parallel.cp={cp}", "parallel.pp_layers=null",
                    f"train.grad_accum={max(cfg.train.grad_accum, pp) if pp > 1 else 1}",
                    f"data.seq_len={cp * chunks * 64}"]  # a valid start; the search moves it
            experts = getattr(cfg.model, "num_experts", 0) or 0
            eps = [e for e in range(1, cp + 1) if cp % e == 0 and (not experts or experts % e == 0)]
            for ep in eps if experts else [1]:
                out.append([*base, f"parallel.ep={ep}"])
        pp *= 2
    return out


def _hardware_overrides() -> list[str]:
    return [f"hardware.{k}={v}" for k, v in HARDWARE.items()]


def _variant(cfg: Any, overrides: Sequence[str]) -> Any:
    from flashcp.plan.report import variant

    return variant(cfg, list(overrides))


def answer(cfg: Any, overrides: list[str]) -> dict[str, Any] | None:
    """The longest sequence of `cfg` with `overrides` (None when that config is invalid)."""
    from flashcp.plan import GIB
    from flashcp.plan.longest import longest, with_seq_len
    from flashcp.plan.steptime import estimate

    new = _variant(cfg, overrides)
    if new is None:
        return None
    par = new.parallel
    head = {
        "overrides": [o for o in overrides if not o.startswith("data.seq_len=")],
        "layout": f"dp {par.dp} × pp {par.pp} × cp {par.cp}"
        + (f" × ep {par.ep}" if par.ep > 1 else ""),
        "gpus": par.world_size,
    }
    found = longest(new)
    if not found.seq_len or found.plan is None:
        return {**head, "longest_seq_len": 0}
    p = found.plan
    at = with_seq_len(new, found.seq_len)
    est = estimate(at, mfu=MFU)
    mixed = estimate(at, mfu=MFU, docs=_mix())
    limit = found.to_json()["limit"]
    host = p.host.peak if p.host is not None else None
    return {
        **head,
        "longest_seq_len": found.seq_len,
        "without_margins_seq_len": found.without_margins,
        "granularity": found.granularity,
        "limit": limit,
        "device_peak_gib": p.peak.total_bytes / GIB,
        "device_moment": p.peak.moment,
        "device_items_gib": {k: v / GIB for k, v in p.peak.items.items() if v},
        "host_peak_gib": host.total_bytes / GIB if host is not None else None,
        "host_items_gib": {k: v / GIB for k, v in host.items.items() if v} if host else {},
        "step_seconds": est.seconds,
        "step_seconds_at_peak": est.seconds_at_peak,
        "step_hfu": est.hfu,
        "executed_over_model": est.executed_over_model,
        "step_seconds_mix": mixed.seconds,
        "copy_hidden": est.copy_hidden,
        "plans": found.plans,
    }


def _mix() -> Any:
    from flashcp.plan.documents import mix

    return mix(MIX)


def practical(spec: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The practical-lengths rows of one model (`row`: its `longest_row`) in its best "after"
    layout: the plan and the step time (one document; the long-tail mix) at each of
    `LENGTHS`, and the lengths at which a step takes `STEP_TARGETS` seconds."""
    from flashcp.config import load_config
    from flashcp.plan import GIB, plan
    from flashcp.plan.longest import granularity, with_seq_len
    from flashcp.plan.steptime import estimate

    cfg = load_config(ROOT / spec["config"], [*spec["overrides"], *_hardware_overrides()],
                      allow_placeholders=True)  # fmt: skip
    new = _variant(cfg, row["after"]["overrides"])
    assert new is not None
    step, docs = granularity(new), _mix()
    longest = row["after"]["longest_seq_len"]
    lengths = []
    for n in LENGTHS:
        at = with_seq_len(new, n)
        p = plan(at)
        lengths.append({
            "seq_len": n,
            "fits": p.fits,
            "device_peak_gib": p.peak.total_bytes / GIB,
            "margin_gib": (p.margin_bytes or 0) / GIB,
            "host_peak_gib": p.host.peak.total_bytes / GIB if p.host is not None else None,
            "step_seconds": estimate(at, mfu=MFU).seconds,
            "step_seconds_mix": estimate(at, mfu=MFU, docs=docs).seconds,
        })  # fmt: skip

    def seconds(n: int, mixed: bool) -> float:
        at = with_seq_len(new, n)
        out = estimate(at, mfu=MFU, docs=docs if mixed else None).seconds
        assert out is not None
        return out

    targets = []
    for target in STEP_TARGETS:
        for mixed in (False, True):
            lo, hi = 1, 1  # granules: seconds(lo) <= target < seconds(hi)
            while seconds(hi * step, mixed) <= target and hi * step < 2**31:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if seconds(mid * step, mixed) <= target else (lo, mid)
            n = lo * step
            targets.append({"seconds": target, "documents": MIX if mixed else "one",
                            "seq_len": n, "fits": n <= longest})  # fmt: skip
    return {"name": row["name"], "layout": row["after"]["layout"], "longest_seq_len": longest,
            "lengths": lengths, "targets": targets}  # fmt: skip


def longest_row(spec: dict[str, Any]) -> dict[str, Any]:
    """One longest-sequence row: the best single-node layout before and after."""
    from flashcp.config import load_config
    from flashcp.models import estimate_parameters

    cfg = load_config(ROOT / spec["config"], [*spec["overrides"], *_hardware_overrides()],
                      allow_placeholders=True)  # fmt: skip
    layouts = node_layouts(cfg)
    out: dict[str, Any] = {
        "name": spec["name"],
        "config": spec["config"],
        "params": estimate_parameters(cfg.model),
        "recipe": cfg.run.recipe + (" + LoRA" if cfg.extras.get("lora") else ""),
    }
    for side, extra in (("before", []), ("after", after_overrides(cfg))):
        results = [r for o in layouts if (r := answer(cfg, [*o, *extra])) is not None]
        best = max(results, key=lambda r: (r["longest_seq_len"], -r.get("gpus", 0)))
        out[side] = best
        out[f"{side}_layouts"] = [
            {"layout": r.get("layout"), "longest_seq_len": r["longest_seq_len"]} for r in results
        ]
    out["after_overrides"] = after_overrides(cfg)
    out["at_target"] = at_target(cfg, out["after"]["overrides"])
    return out


def at_target(cfg: Any, overrides: list[str]) -> dict[str, Any] | None:
    """The "after" plan at `TARGET` tokens in the best layout: whether it fits, its peaks."""
    from flashcp.plan import GIB, plan
    from flashcp.plan.longest import granularity, with_seq_len

    new = _variant(cfg, overrides)
    if new is None or TARGET % granularity(new):
        return None
    p = plan(with_seq_len(new, TARGET))
    return {
        "seq_len": TARGET,
        "fits": p.fits,
        "peak_gib": p.peak.total_bytes / GIB,
        "moment": p.peak.moment,
        "host_peak_gib": p.host.peak.total_bytes / GIB if p.host is not None else None,
    }


def model_per_node() -> dict[str, Any]:
    """The fewest GPUs (then the lowest peak) on which `MODEL_PER_NODE` fits 96 GiB, before
    and after; dp 1, cp up to a node, ep dividing cp, pp up to the layers."""
    from flashcp.config import load_config
    from flashcp.plan import GIB, plan

    spec = MODEL_PER_NODE
    cfg = load_config(ROOT / spec["config"], _hardware_overrides(), allow_placeholders=True)
    experts = cfg.model.num_experts
    candidates = []
    for cp in (1, 2, 4, 8):
        for ep in [e for e in range(1, cp + 1) if cp % e == 0 and experts % e == 0]:
            for pp in range(1, cfg.model.num_layers + 1):
                world = pp * cp
                if world > cfg.parallel.world_size:
                    break
                candidates.append((world, pp, cp, ep))
    candidates.sort()
    out: dict[str, Any] = {**spec, "shipped": {
        "gpus": cfg.parallel.world_size,
        "layout": f"dp 1 × pp {cfg.parallel.pp} × cp {cfg.parallel.cp}",
        "peak_gib": plan(cfg).peak.total_bytes / GIB,
    }}  # fmt: skip
    variant = load_config(ROOT / spec["variant"], allow_placeholders=True)
    vp, par = plan(variant), variant.parallel
    out["shipped_variant"] = {
        "gpus": par.world_size,
        "layout": f"dp {par.dp} × pp {par.pp} × cp {par.cp} × ep {par.ep}",
        "peak_gib": vp.peak.total_bytes / GIB,
        "moment": vp.peak.moment,
        "largest_item": vp.peak.largest_item()[0],
    }
    for side, extra in (("before", []), ("after", list(PER_NODE_AFTER))):
        best = None
        for world, pp, cp, ep in candidates:
            if best is not None and world > best["gpus"]:
                break
            new = _variant(cfg, [f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.ep={ep}",
                                 "parallel.pp_layers=null",
                                 f"train.grad_accum={max(cfg.train.grad_accum, pp)}",
                                 f"data.seq_len={spec['seq_len']}", *extra])  # fmt: skip
            if new is None:
                continue
            p = plan(new)
            if not p.fits:
                continue
            record = {
                "gpus": world,
                "nodes": -(-world // int(HARDWARE["gpus_per_node"])),
                "layout": f"dp 1 × pp {pp} × cp {cp} × ep {ep}",
                "peak_gib": p.peak.total_bytes / GIB,
                "moment": p.peak.moment,
                "largest_item": p.peak.largest_item()[0],
                "host_peak_gib": p.host.peak.total_bytes / GIB if p.host is not None else None,
            }
            if best is None or record["peak_gib"] < best["peak_gib"]:
                best = record
        out[side] = best
    return out


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
    except OSError:
        return ""
    return out.stdout.strip()


def view(rec: dict[str, Any]) -> dict[str, Any]:
    """The page's derived figures: ratios after/before, and whether the target is met."""
    rows = rec["rows"]
    glm = [r for r in rows if r["name"].startswith("GLM-4-9B")]
    return {
        "met": all(r["after"]["longest_seq_len"] >= rec["target"] for r in glm),
        "gains": {r["name"]: r["after"]["longest_seq_len"] / max(r["before"]["longest_seq_len"], 1)
                  for r in rows},  # fmt: skip
        "gib": 2**30,
    }


PAGE = Page("long_context.md.j2", DOCS / "long_context.json", view=view)
"""`docs/long_context.md`, from `docs/long_context.json` alone."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    PAGE.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.report_only:
        return PAGE.rewrite(args)
    start = time.perf_counter()
    rows = []
    for spec in ROWS:
        row = longest_row(spec)
        print(f"{row['name']}: before {row['before']['longest_seq_len']:,} "
              f"({row['before']['layout']}), after {row['after']['longest_seq_len']:,} "
              f"({row['after']['layout']})", flush=True)  # fmt: skip
        rows.append(row)
    lengths = [practical(spec, row) for spec, row in zip(ROWS, rows, strict=True)]
    for x in lengths:
        print(f"{x['name']}: ~1 min / ~10 min per step at "
              + ", ".join(f"{t['seq_len']:,} ({t['documents']})" for t in x["targets"]),
              flush=True)  # fmt: skip
    per_node = model_per_node()
    print(f"{per_node['name']}: before {per_node['before']}, after {per_node['after']}")
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    rec = {
        "hardware": HARDWARE,
        "mfu": MFU,
        "target": TARGET,
        "after_overrides": list(AFTER),
        "per_node_after_overrides": list(PER_NODE_AFTER),
        "rows": rows,
        "practical": lengths,
        "mix": MIX,
        "model_per_node": per_node,
        "alst": ALST,
        "commit": _commit(),
        "seconds": round(time.perf_counter() - start, 1),
        "command": f"python scripts/bench_long_context.py {argv_text}".strip(),
    }
    PAGE.write(args, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
