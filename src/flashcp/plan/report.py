"""A plan as text, the over-budget message `flashcp validate` prints, and changes that fit.

`fit_options(cfg, budget_gib)` searches the knobs that lower the peak without more devices —
loss chunking, full recompute, ZeRO-1 sharding, bf16 parameter storage — and reports the
smallest sets of them that fit; when none does, all of them together with the pipeline and/or
context-parallel degree multiplied, fewest devices first (with `train.grad_accum` raised to pp
when the schedule needs it). Every candidate is a valid config
(`flashcp.config.collect`), planned like the original.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashcp.attention import registry as cp_modes
from flashcp.config import Config, collect, to_dict
from flashcp.plan.model import GIB, ITEM_DOCS, Plan, plan

GPUS_PER_NODE = 8
MAX_WORLD = 256
SMALL_CHUNK = 1024
"""`train.loss_chunk_tokens` the fit search proposes."""


@dataclass(frozen=True)
class FitOption:
    """A set of overrides and the planned peak of its largest rank."""

    overrides: tuple[str, ...]
    peak_bytes: int
    world: int

    @property
    def nodes(self) -> int:
        return -(-self.world // GPUS_PER_NODE)

    def to_json(self) -> dict[str, Any]:
        return {
            "overrides": list(self.overrides),
            "peak_bytes": self.peak_bytes,
            "world": self.world,
            "nodes": self.nodes,
        }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _size(n: float) -> str:
    """GiB from 1 GiB up, MiB below (tiny CPU configs)."""
    return f"{n / GIB:8.3f} GiB" if n >= GIB else f"{n / 2**20:8.3f} MiB"


def variant(cfg: Config, overrides: Sequence[str]) -> Config | None:
    """`cfg` with `overrides` applied, or None when that config is invalid (static: unfilled
    `/path/to/` placeholders are no reason, the plan reads the model's shape keys)."""
    raw = to_dict(cfg)
    new, errors = collect(
        raw, source=cfg.source, overrides=list(overrides), allow_placeholders=True
    )
    return None if errors or new is None else new


def _peak(cfg: Config, device: str | None, budget_gib: float) -> int:
    return plan(cfg, device=device, budget_gib=budget_gib).peak.total_bytes


def _cheap_knobs(cfg: Config) -> list[str]:
    out = []
    chunk = cfg.train.loss_chunk_tokens
    if chunk == 0 or chunk > SMALL_CHUNK:
        out.append(f"train.loss_chunk_tokens={SMALL_CHUNK}")
    if cfg.model.recompute != "full":
        out.append("model.recompute=full")
    if not cfg.parallel.shard_optimizer and cfg.parallel.dp * cfg.parallel.cp > 1:
        out.append("parallel.shard_optimizer=true")
    if cfg.train.param_dtype != "bfloat16":
        out.append("train.param_dtype=bfloat16")
    return out


def _degree(cfg: Config, dim: str, value: int) -> list[str] | None:
    """Overrides setting parallel.`dim` to `value`, or None when that layout is impossible."""
    p = cfg.parallel
    if value == getattr(p, dim):
        return []
    out = [f"parallel.{dim}={value}"]
    if dim == "pp":
        if value > cfg.model.num_layers:
            return None
        if p.pp_layers is not None:
            out.append("parallel.pp_layers=null")
        if cfg.train.grad_accum < value:
            out.append(f"train.grad_accum={value}")
    elif cfg.data.seq_len % (value * cp_modes.get(p.cp_mode).chunks_per_rank) and not p.pad:
        return None
    return out


def fit_options(
    cfg: Config, *, budget_gib: float, device: str | None = None, limit: int = 4
) -> list[FitOption]:
    """Changes (override lists) under which every rank's plan fits `budget_gib`: the smallest
    sets of the cheap knobs that fit on the same devices; failing those, all knobs with the
    pipeline and/or context-parallel degree multiplied, fewest devices first."""
    budget = budget_gib * GIB

    def attempt(overrides: list[str]) -> FitOption | None:
        new = variant(cfg, overrides)
        if new is None:
            return None
        peak = _peak(new, device, budget_gib)
        option = FitOption(tuple(overrides), peak, new.parallel.world_size)
        return option if peak <= budget else None

    knobs = _cheap_knobs(cfg)
    found: list[FitOption] = []
    for size in range(1, len(knobs) + 1):
        for combo in itertools.combinations(knobs, size):
            if any(set(o.overrides) <= set(combo) for o in found):
                continue  # a smaller set already fits
            if (o := attempt(list(combo))) is not None:
                found.append(o)
    if not found:
        p = cfg.parallel
        grid = []
        for pp in (p.pp * f for f in (1, 2, 4, 8, 16, 32)):
            for cp in sorted(
                {max(1, p.cp // 4), max(1, p.cp // 2), *(p.cp * f for f in (1, 2, 4))}
            ):
                world = p.dp * pp * cp
                if (pp, cp) == (p.pp, p.cp) or world > MAX_WORLD:
                    continue
                a, b = _degree(cfg, "pp", pp), _degree(cfg, "cp", cp)
                if a is not None and b is not None:
                    grid.append((world, pp, a + b))
        best_world = None
        for world, _, extra in sorted(grid, key=lambda g: (g[0], g[1])):
            if best_world is not None and world > best_world:
                break
            if (o := attempt([*knobs, *extra])) is not None:
                found.append(o)
                best_world = world
    found.sort(key=lambda o: (o.world, len(o.overrides), o.peak_bytes))
    return found[:limit]


def over_budget(p: Plan) -> str | None:
    """The message for a plan over its budget (None when it fits or has no budget)."""
    if p.fits or p.budget_bytes is None:
        return None
    worst = p.peak
    name, size = worst.largest_item()
    over = [r.rank for r in p.ranks if r.total_bytes > p.budget_bytes]
    ranks = f"rank {worst.rank}" if len(over) == 1 else f"{len(over)} ranks, e.g. {worst.rank}"
    return (
        f"the memory plan exceeds {_gib(p.budget_bytes)} per device: {ranks} (stage "
        f"{worst.stage}) peaks at {_gib(worst.total_bytes)} ({worst.moment}); largest item "
        f"{name} {_gib(size)} ({ITEM_DOCS[name]})"
    )


def refusal(cfg: Config, p: Plan, device: str | None = None) -> str | None:
    """`over_budget` plus what to change (`fit_options`), for `flashcp validate`."""
    message = over_budget(p)
    if message is None:
        return None
    assert p.budget_bytes is not None
    options = fit_options(cfg, budget_gib=p.budget_bytes / GIB, device=device, limit=3)
    if options:
        fixes = "; or ".join(
            f"{' '.join(o.overrides)} (→ {_gib(o.peak_bytes)}, {o.world} devices)" for o in options
        )
        message += f". To fit, set: {fixes}"
    else:
        message += (
            ". No single change found: raise parallel.pp / parallel.cp, set "
            "model.recompute=full, train.loss_chunk_tokens, parallel.shard_optimizer=true and "
            "train.param_dtype=bfloat16"
        )
    return message + " (`flashcp plan` shows every item)"


def format_plan(p: Plan, cfg: Config, *, source: str = "") -> str:
    """The human-readable plan: per stage (its ranks are equal), every item at the peak."""
    par = cfg.parallel
    lines = [
        f"flashcp plan {source}: {len(p.ranks)} rank(s) (dp {par.dp} × pp {par.pp} × cp "
        f"{par.cp}{f', ep {par.ep}' if par.ep > 1 else ''}), {p.device}, compute "
        f"{p.compute_dtype}, parameters {p.param_dtype}, "
        f"recompute {cfg.model.recompute}",
        "budget: "
        + (f"{_gib(p.budget_bytes)} per device" if p.budget_bytes is not None else "none "
           "(hardware.memory_gib is null; --device-memory GiB sets one)"),
    ]  # fmt: skip
    for r in p.stages():
        ranks = [x.rank for x in p.ranks if x.stage == r.stage]
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"
        first, last = r.layers.start, r.layers.stop - 1
        layers = f"layers {first}-{last}" if last > first else f"layer {first}"
        verdict = ""
        if p.budget_bytes is not None:
            verdict = "  fits" if r.total_bytes <= p.budget_bytes else "  DOES NOT FIT"
        lines += [
            "",
            f"stage {r.stage} (rank{'s' if len(ranks) > 1 else ''} {span}), {layers}: peak "
            f"{_size(r.total_bytes).strip()} at "
            f"'{r.moment}'{verdict}",
        ]
        for name, size in sorted(r.items.items(), key=lambda kv: -kv[1]):
            if size:
                lines.append(f"  {name:<26} {_size(size)}  {ITEM_DOCS[name]}")
        others = ", ".join(f"{m} {_size(t).strip()}" for m, t in r.totals.items() if m != r.moment)
        if others:
            lines.append(f"  (other moments: {others})")
    for note in p.notes:
        lines.append(f"note: {note}")
    if p.budget_bytes is not None:
        message = over_budget(p)
        lines.append("")
        lines.append("fits: yes" if message is None else f"fits: NO — {message}")
    return "\n".join(lines)
