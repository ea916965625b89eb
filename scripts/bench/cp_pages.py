"""The two CP pages, `docs/cp_bench.md` and `docs/cp_balance.md`, every figure from the JSON
the parts of `bench.cp` write.

`docs/cp_comm.json`, `docs/cp_scaling.json`, `docs/cp_balance.json` (the tile model) and
`docs/cp_balance_time.json` (measured per-rank attention time) go in; the views below pick
and derive the figures, the templates (`cp_bench.md.j2`, `cp_balance.md.j2`, their tables in
`cp_tables.md.j2`) hold the prose. A part that has not run yet shows the command that produces
it. `tests/unit/bench/test_docs.py` regenerates the pages from the committed JSON and compares.

    python scripts/bench_cp.py --part docs    # rewrite both pages from the JSON files
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import report

CP_BENCH = "cp_bench.md"
CP_BALANCE = "cp_balance.md"
COMM_JSON = "cp_comm.json"
SCALING_JSON = "cp_scaling.json"
BALANCE_JSON = "cp_balance.json"
BALANCE_TIME_JSON = "cp_balance_time.json"
UNCONTENDED_SHARE = 0.9
"""A scaling round counts as uncontended when every process of both launches got at least this
fraction of a core (median CPU time / wall time over its timed iterations)."""
TARGET_FAMILIES = (
    "causal_document",
    "share_question",
    "causal_document_packed",
    "share_question_packed",
)
PACKED_FAMILIES = ("causal_document_packed", "share_question_packed")
TABLES = "cp_tables.md.j2"

Record = dict[str, Any]


def load(path: Path) -> Record | None:
    return json.loads(path.read_text()) if path.exists() else None


def find(rows: list[Record], family: str, cp: int, mode: str, k: int | None = None) -> Any:
    """The row of (family, cp, mode) — with `k` chunks per rank if given — or None."""
    for r in rows:
        if (r["family"], r["cp"], r["mode"]) == (family, cp, mode) and (
            k is None or r["chunks_per_rank"] == k
        ):
            return r
    return None


# ============================================================================================
# cp_bench.md: parts comm and scaling


def transport_equal(row: Record) -> bool:
    """Counters equal the tapped transport bytes, and nothing bypassed the tap."""
    return (
        row.get("transport_sent") == row["sent"]
        and row.get("transport_received") == row["received"]
        and row.get("transport_other_calls") == 0
    )


def comm_groups(result: Record) -> list[Record]:
    """Per (cp, mode, direction), in the order run: the ratios over ranks and the tap check."""
    keys = list(dict.fromkeys((r["cp"], r["mode"], r["direction"]) for r in result["rows"]))
    groups = []
    for cp, mode, direction in keys:
        key = (cp, mode, direction)
        rows = [r for r in result["rows"] if (r["cp"], r["mode"], r["direction"]) == key]
        groups.append(
            {
                "cp": cp,
                "mode": mode,
                "direction": direction,
                "per_op": rows[0]["per_op"],
                "theoretical": rows[0]["theoretical"],
                "sent": [r["ratio_sent"] for r in rows],
                "received": [r["ratio_received"] for r in rows],
                "equal": all(transport_equal(r) for r in rows),
                "wire": [r["ratio_wire_sent"] for r in rows if r["ratio_wire_sent"] is not None],
            }
        )
    return groups


def comm_view(result: Record) -> Record:
    """The figures of the comm result paragraph."""
    rows, cps = result["rows"], result["config"]["cps"]
    forward = [r for r in rows if r["direction"] == "forward"]
    return {
        "directions": [
            (d, [r["ratio_sent"] for r in rows if r["direction"] == d]
             + [r["ratio_received"] for r in rows if r["direction"] == d])
            for d in ("forward", "backward")
        ],  # fmt: skip
        "equal": sum(transport_equal(r) for r in rows),
        "wire": [r["ratio_wire_sent"] for r in rows if r["ratio_wire_sent"] is not None],
        "forward_bytes": [
            (cp, next(r["theoretical"] for r in forward if r["cp"] == cp)) for cp in cps
        ],
        "loads": load_values(
            [(x["loadavg_before"], x["loadavg_after"]) for x in result["config"].get("load", [])]
        ),
        "groups": comm_groups(result),
    }


def load_values(pairs: list[tuple[list[float], list[float]]]) -> list[float]:
    """1-minute load averages before and after each launch (where recorded)."""
    return [v[0] for before, after in pairs for v in (before, after) if v]


def summarize_rounds(launches: list[Record], cp: int) -> list[Record]:
    """Per round: both launches' median step, their ratio, the load and the lowest CPU share."""
    rows = []
    for round_ in sorted({x["round"] for x in launches}):
        one = next(x for x in launches if x["round"] == round_ and x["cp"] == 1)
        many = next(x for x in launches if x["round"] == round_ and x["cp"] == cp)
        rows.append(
            {
                "round": round_,
                "cp1": one["step"]["total"],
                f"cp{cp}": many["step"]["total"],
                "speedup": one["step"]["total"] / many["step"]["total"],
                "other_cores": [one["other_cores"], many["other_cores"]],
                "min_cpu_share": min(r["cpu_share"] for x in (one, many) for r in x["ranks"]),
            }
        )
    return rows


def scaling_view(result: Record) -> Record:
    """Per-round ratios, uncontended rounds, and the figures of 'Reading the numbers'."""
    cfg = result["config"]
    cp = cfg["cp"]
    rounds = summarize_rounds(result["launches"], cp)
    ranks = [r for x in result["launches"] if x["cp"] == cp for r in x["ranks"]]
    iso = [r["isolated_comm"] for r in ranks if r["isolated_comm"]]
    steps = [r["total"] for r in ranks]
    kv_bytes = cfg["batch"] * cfg["seq_len"] * cfg["kv_heads"] * cfg["head_dim"] * 4
    return {
        "cp": cp,
        "rounds": rounds,
        "clean": [r["speedup"] for r in rounds if r["min_cpu_share"] >= UNCONTENDED_SHARE],
        "shares": [r["min_cpu_share"] for r in rounds],
        "others": [c for r in rounds for c in r["other_cores"] if c is not None],
        "iso_forward": [i["forward"] for i in iso],
        "iso_backward": [i["backward"] for i in iso],
        "iso_share_of_step": [
            100 * (i["forward"] + i["backward"]) / s for i, s in zip(iso, steps, strict=True)
        ]
        if iso
        else [],
        "inside": [r["comm_forward"] + r["comm_backward"] for r in ranks],
        "plans_ms": [1000 * r["plan"] for x in result["launches"] for r in x["ranks"]],
        "forward_bytes": (cp - 1) / cp * 2 * kv_bytes,
        "loads": load_values(
            [(x["loadavg_before"], x["loadavg_after"]) for x in result["launches"]]
        ),
    }


def render_cp_bench(comm: Record | None, scaling: Record | None, *, target: float = 1.7) -> str:
    """The whole of docs/cp_bench.md."""
    return report.render(
        "cp_bench.md.j2",
        comm=comm,
        scaling=scaling,
        target=scaling["config"].get("target", target) if scaling else target,
        c=comm_view(comm) if comm else None,
        s=scaling_view(scaling) if scaling else None,
        **names(),
    )


def names() -> Record:
    return {
        "comm_json": COMM_JSON,
        "scaling_json": SCALING_JSON,
        "balance_json": BALANCE_JSON,
        "balance_time_json": BALANCE_TIME_JSON,
        "uncontended": UNCONTENDED_SHARE,
    }


# ============================================================================================
# cp_balance.md: parts balance (the tile model) and balance_time (measured)


def balance_rows(result: Record) -> list[Record]:
    """Per (family, cp): the three layouts' rows and the best balanced k (the model table)."""
    cfg, rows = result["config"], result["rows"]
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        for cp in cfg["cps"]:
            key = (family, cp, "workload_balanced")
            balanced = [r for r in rows if (r["family"], r["cp"], r["mode"]) == key]
            k_ok = result["needed_chunks_per_rank"][family][str(cp)]
            best = (
                find(rows, family, cp, "workload_balanced", k_ok)
                if k_ok is not None
                else min(balanced, key=lambda r: r["imbalance"], default=None)
            )
            out.append(
                {
                    "family": family,
                    "cp": cp,
                    "target": family in TARGET_FAMILIES,
                    "layouts": [
                        find(rows, family, cp, "contiguous"),
                        find(rows, family, cp, "dualchunk"),
                        find(rows, family, cp, "workload_balanced", 2),
                    ],
                    "best": best,
                    "best_ok": k_ok is not None,
                }
            )
    return out


def balance_view(result: Record) -> Record:
    """The model table's rows and the figures of the summary bullets and the tiles paragraph."""
    cfg, rows = result["config"], result["rows"]
    cps = cfg["cps"]
    needed = result["needed_chunks_per_rank"]
    targets = [f for f in TARGET_FAMILIES if f in needed]
    k2 = [find(rows, f, cp, "workload_balanced", 2) for f in targets for cp in cps]
    worst = max(
        ((f, k) for f, per in needed.items() for k in per.values() if k is not None),
        key=lambda x: x[1],
        default=None,
    )
    ablation = result.get("ablation", [])
    sq = [a for a in ablation if a["family"] == "share_question_packed" and a["cp"] == max(cps)]
    return {
        "rows": balance_rows(result),
        "causal_dual": [find(rows, "causal", cp, "dualchunk") for cp in cps]
        if "causal" in needed
        else [],
        "causal_contiguous": [find(rows, "causal", cp, "contiguous") for cp in cps],
        "targets": targets,
        "target_ks": sorted(
            {needed[f][str(cp)] for f in targets for cp in cps}, key=lambda k: k or 0
        ),
        "at_k": [
            find(rows, f, cp, "workload_balanced", needed[f][str(cp)])
            for f in targets
            for cp in cps
            if needed[f][str(cp)] is not None
        ],
        "k2": [r for r in k2 if r],
        "packed_dual": [
            (f, [find(rows, f, cp, "dualchunk")["imbalance"] for cp in cps])
            for f in PACKED_FAMILIES
            if f in needed
        ],
        "worst": worst,
        "worst_families": sorted({f for f, per in needed.items() if worst[1] in per.values()})
        if worst
        else [],
        "missing": [
            f"{f} cp={cp}" for f, per in needed.items() for cp, k in per.items() if k is None
        ],
        "eviction": [
            r for r in (find(rows, "random_eviction", cp, "dualchunk") for cp in cps) if r
        ],
        "eviction_ablation": [a for a in ablation if a["family"] == "random_eviction"],
        "sq_ablation": max(sq, key=lambda a: a["chunks_per_rank"]) if sq else None,
    }


def balance_time_view(result: Record) -> Record:
    """Per cp: the noise-floor control and every family's layouts; cps beyond the cores."""
    cfg, rows = result["config"], result["rows"]
    per_cp = []
    for cp in sorted({r["cp"] for r in rows}):
        control = next(
            (r for r in rows if (r["cp"], r["family"], r["mode"]) == (cp, "causal", "dualchunk")),
            None,
        )
        families = [
            (family, {r["mode"]: r for r in rows if (r["cp"], r["family"]) == (cp, family)})
            for family in dict.fromkeys(r["family"] for r in rows if r["cp"] == cp)
        ]
        per_cp.append({"cp": cp, "control": control, "families": families})
    return {
        "per_cp": per_cp,
        "over": [cp for cp in cfg["cps"] if cfg.get("cpu_count") and cp > cfg["cpu_count"]],
    }


def render_cp_balance(model: Record | None, timed: Record | None) -> str:
    """The whole of docs/cp_balance.md."""
    return report.render(
        "cp_balance.md.j2",
        model=model,
        timed=timed,
        m=balance_view(model) if model else None,
        t=balance_time_view(timed) if timed else None,
        **names(),
    )


# ============================================================================================


def comm_table(result: Record) -> str:
    """The comm part's table alone (for its terminal output)."""
    return report.macro(TABLES, "comm_table")(result, comm_groups(result))


def scaling_table(result: Record, target: float) -> str:
    """The scaling part's tables alone."""
    return report.macro(TABLES, "scaling_table")(result, target, scaling_view(result), names())


def balance_table(result: Record) -> str:
    """The balance part's (model) tables alone."""
    return report.macro(TABLES, "balance_table")(result, balance_rows(result))


def balance_time_table(result: Record) -> str:
    """The balance_time part's table alone."""
    return report.macro(TABLES, "balance_time_table")(result)


def write_cp_docs(out_dir: Path) -> list[Path]:
    """Regenerate both pages in `out_dir` from the JSON files there; returns the pages."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = out_dir / CP_BENCH
    balance = out_dir / CP_BALANCE
    bench.write_text(render_cp_bench(load(out_dir / COMM_JSON), load(out_dir / SCALING_JSON)))
    balance.write_text(
        render_cp_balance(load(out_dir / BALANCE_JSON), load(out_dir / BALANCE_TIME_JSON))
    )
    return [bench, balance]
