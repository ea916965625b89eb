"""A plan as text, the over-budget message `flashcp validate` prints, and changes that fit.

`fit_options(cfg, budget_gib)` searches the knobs that lower the peak without more devices —
loss chunking, full recompute, ZeRO-1 sharding, bf16 parameter storage, activation offload, a
bf16 residual stream, ZeRO-2 gradient sharding — and reports the
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
from flashcp.plan.comms import NCCL_COMMUNICATOR_BYTES
from flashcp.plan.host import HOST_ITEM_DOCS
from flashcp.plan.model import GIB, ITEM_DOCS, Plan, plan
from flashcp.problems import Problem

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


def budget_text(budget: int, margin: float, key: str) -> str:
    """"91.20 GiB (96.00 GiB less 5 % hardware.memory_headroom)": a usable budget with its
    margin named (just the budget when there is none)."""
    if not margin:
        return _gib(budget)
    return f"{_gib(int(budget * (1 - margin)))} ({_gib(budget)} less {_pct(margin)} {key})"


def _pct(fraction: float) -> str:
    """0.05 → "5 %"."""
    return f"{fraction * 100:g} %"


HOST_FIXES = (
    "lower data.seq_len (`flashcp plan CONFIG --longest` finds the longest that fits), set "
    "model.residual_dtype=bfloat16 (half the bytes an offload moves), spread the job over "
    "more nodes (fewer ranks per node), or raise hardware.host_memory_gib if the nodes have "
    "more (lowering hardware.host_memory_reserve leaves the operating system less)"
)
"""What lowers a node's host plan, for the refusal."""


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
    # issue 20's mechanisms (each validated with the others the set holds: offload needs
    # recompute, ZeRO-2 needs ZeRO-1)
    if not cfg.train.offload_activations:
        out.append("train.offload_activations=true")
    if cfg.model.residual_dtype == "float32":
        out.append("model.residual_dtype=bfloat16")
    sharded = cfg.parallel.shard_optimizer or "parallel.shard_optimizer=true" in out
    if not cfg.parallel.shard_gradients and cfg.extras.get("lora") is None and sharded:
        out.append("parallel.shard_gradients=true")
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
    """Changes (override lists) under which every rank's plan fits `budget_gib` less the
    config's `hardware.memory_headroom`: the smallest sets of the cheap knobs that fit on the
    same devices; failing those, all knobs with the pipeline and/or context-parallel degree
    multiplied, fewest devices first."""

    def attempt(overrides: list[str]) -> FitOption | None:
        new = variant(cfg, overrides)
        if new is None:
            return None
        p = plan(new, device=device, budget_gib=budget_gib)
        option = FitOption(tuple(overrides), p.peak.total_bytes, new.parallel.world_size)
        return option if p.device_fits else None

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
    if p.device_fits or p.budget_bytes is None:
        return None
    worst = p.peak
    name, size = worst.largest_item()
    use = p.usable_bytes
    assert use is not None
    over = [r.rank for r in p.ranks if r.total_bytes > use]
    ranks = f"rank {worst.rank}" if len(over) == 1 else f"{len(over)} ranks, e.g. {worst.rank}"
    budget = budget_text(p.budget_bytes, p.headroom, "hardware.memory_headroom")
    return (
        f"the memory plan exceeds {budget} per device: {ranks} (stage "
        f"{worst.stage}) peaks at {_gib(worst.total_bytes)} ({worst.moment}); largest item "
        f"{name} {_gib(size)} ({ITEM_DOCS[name]})"
    )


def host_over_budget(p: Plan) -> str | None:
    """The message for a host plan over its per-node budget (None when it fits or has none)."""
    host = p.host
    if host is None or host.budget_bytes is None or host.fits:
        return None
    worst = host.peak
    name, size = worst.largest_item()
    use = host.usable_bytes
    assert use is not None
    over = [x.node for x in host.nodes() if x.total_bytes > use]
    nodes = f"node {worst.node}" if len(over) == 1 else f"{len(over)} nodes, e.g. {worst.node}"
    span = f"{worst.ranks[0]}-{worst.ranks[-1]}" if len(worst.ranks) > 1 else f"{worst.ranks[0]}"
    budget = budget_text(host.budget_bytes, host.reserve, "hardware.host_memory_reserve")
    return (
        f"the host memory plan exceeds {budget} per node: {nodes} (ranks "
        f"{span}, {host.ranks_per_node} per node) peaks at {_gib(worst.total_bytes)} "
        f"({worst.moment}); largest item {name} {_gib(size)} ({HOST_ITEM_DOCS[name]})"
    )


def device_budget_problems(cfg: Config, p: Plan, device: str | None = None) -> list[Problem]:
    """The plan `p` of `cfg` over its per-device budget (`hardware.memory_gib`,
    `over_budget`) with what to change (`fit_options`, each checked to fit); none when it
    fits or has no budget."""
    message = over_budget(p)
    if message is None:
        return []
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
    return [Problem("hardware.memory_gib", message + " (`flashcp plan` shows every item)")]


def host_budget_problems(p: Plan) -> list[Problem]:
    """The host plan of `p` over its per-node budget (`hardware.host_memory_gib`,
    `host_over_budget`) with what to change; none when it fits or has no budget."""
    message = host_over_budget(p)
    if message is None:
        return []
    text = f"{message}. To fit: {HOST_FIXES} (`flashcp plan` shows every item)"
    return [Problem("hardware.host_memory_gib", text)]


def format_plan(p: Plan, cfg: Config, *, source: str = "") -> str:
    """The human-readable plan: per stage (its ranks are equal), every item at the peak."""
    par = cfg.parallel
    lines = [
        f"flashcp plan {source}: {len(p.ranks)} rank(s) (dp {par.dp} × pp {par.pp} × cp "
        f"{par.cp}{f', ep {par.ep}' if par.ep > 1 else ''}), {p.device}, compute "
        f"{p.compute_dtype}, parameters {p.param_dtype}, "
        f"recompute {cfg.model.recompute}",
        "budget: "
        + (f"{budget_text(p.budget_bytes, p.headroom, 'hardware.memory_headroom')} per device"
           if p.budget_bytes is not None else "none (hardware.memory_gib is null; "
           "--device-memory GiB sets one)"),
    ]  # fmt: skip
    for r in p.stages():
        ranks = [x.rank for x in p.ranks if x.stage == r.stage]
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"
        first, last = r.layers.start, r.layers.stop - 1
        layers = f"layers {first}-{last}" if last > first else f"layer {first}"
        depths = cfg.model.mtp_layers if r.stage == par.pp - 1 else 0
        if depths:  # `flashcp.models.mtp`: on the last stage, after the decoder layers
            n = cfg.model.num_layers
            state = "trained" if cfg.model.mtp_trained else "frozen"
            mtp = f"layers {n}-{n + depths - 1}" if depths > 1 else f"layer {n}"
            layers += f" + MTP {mtp} ({state})"
        verdict = ""
        if p.usable_bytes is not None and p.budget_bytes is not None:
            verdict = _verdict(p.usable_bytes - r.total_bytes, p.budget_bytes - p.usable_bytes,
                               "headroom")  # fmt: skip
        lines += [
            "",
            f"stage {r.stage} (rank{'s' if len(ranks) > 1 else ''} {span}), {layers}: peak "
            f"{_size(r.total_bytes).strip()} at "
            f"'{r.moment}'{verdict}",
        ]
        for name, size in sorted(r.items.items(), key=lambda kv: -kv[1]):
            if size:
                lines.append(f"  {name:<26} {_size(size)}  {ITEM_DOCS[name]}")
        if r.communicators is not None and r.communicators.count:
            lines.append(f"  (rank {r.rank}: {r.communicators.describe()}, "
                         f"{_gib(NCCL_COMMUNICATOR_BYTES).strip()} each)")  # fmt: skip
        others = ", ".join(f"{m} {_size(t).strip()}" for m, t in r.totals.items() if m != r.moment)
        if others:
            lines.append(f"  (other moments: {others})")
    lines += format_host(p)
    for note in p.notes:
        lines.append(f"note: {note}")
    lines += ["", *_fits_lines(cfg, p)] if _has_budget(p) else []
    return "\n".join(lines)


def _has_budget(p: Plan) -> bool:
    return p.budget_bytes is not None or (p.host is not None and p.host.budget_bytes is not None)


def _fits_lines(cfg: Config, p: Plan) -> list[str]:
    """"fits: yes", or "fits: NO" with what is over and the fixes `flashcp validate` prints
    (`device_budget_problems`, `host_budget_problems`: the same changes, each checked to fit)."""
    problems = device_budget_problems(cfg, p, p.device) + host_budget_problems(p)
    return ["fits: yes"] if not problems else [f"fits: NO — {x.problem}" for x in problems]


def _fits_text(usable: int | None, peak: int) -> str:
    """", fits (1.2 GiB left)" / ", DOES NOT FIT (3.4 GiB over)" ("" without a budget)."""
    if usable is None:
        return ""
    left = usable - peak
    return (f", fits ({_size(left).strip()} left)" if left >= 0
            else f", DOES NOT FIT ({_size(-left).strip()} over)")  # fmt: skip


def format_summary(p: Plan, cfg: Config, *, source: str = "") -> str:
    """`flashcp plan --summary`: one line per pipeline stage (its peak, whether it fits, its
    largest item) and per kind of node for the host, then whether the job fits (with the
    fixes when it does not)."""
    par = cfg.parallel
    budget = (budget_text(p.budget_bytes, p.headroom, "hardware.memory_headroom")
              if p.budget_bytes is not None else "none")  # fmt: skip
    lines = [f"flashcp plan {source}: {len(p.ranks)} rank(s) (dp {par.dp} × pp {par.pp} × cp "
             f"{par.cp}{f', ep {par.ep}' if par.ep > 1 else ''}), {p.device} "
             f"{p.compute_dtype}; budget {budget} per device"]  # fmt: skip
    for r in p.stages():
        verdict = _fits_text(p.usable_bytes, r.total_bytes)
        name, size = r.largest_item()
        lines.append(f"stage {r.stage}: peak {_size(r.total_bytes).strip()} at '{r.moment}'"
                     f"{verdict}; largest {name} {_size(size).strip()}")  # fmt: skip
    host = p.host
    if host is not None and (host.budget_bytes is not None
                             or any(x.total_bytes for x in host.nodes())):  # fmt: skip
        x = host.peak
        verdict = _fits_text(host.usable_bytes, x.total_bytes)
        name, size = x.largest_item()
        lines.append(f"host, node {x.node} ({host.ranks_per_node} ranks): peak "
                     f"{_size(x.total_bytes).strip()} at '{x.moment}'{verdict}; largest {name} "
                     f"{_size(size).strip()}")  # fmt: skip
    if _has_budget(p):
        lines += _fits_lines(cfg, p)
    return "\n".join(lines)


def _verdict(left: int, margin: int, name: str) -> str:
    """"  fits, 0.11 GiB left beyond the 4.80 GiB headroom" / "  DOES NOT FIT, 1.2 GiB over"."""
    beyond = f" beyond the {_gib(margin)} {name}" if margin else ""
    if left >= 0:
        return f"  fits, {_size(left).strip()} left{beyond}"
    less = f" the budget less its {name}" if margin else ""
    return f"  DOES NOT FIT, {_size(-left).strip()} over{less}"


def format_host(p: Plan) -> list[str]:
    """The host plan's lines: per node its items at its peak (nothing when every item is 0
    and there is no host budget)."""
    host = p.host
    if host is None:
        return []
    nodes = host.nodes()
    if host.budget_bytes is None and not any(x.total_bytes for x in nodes):
        return []
    budget = (f"{budget_text(host.budget_bytes, host.reserve, 'hardware.host_memory_reserve')}"
              " per node" if host.budget_bytes is not None
              else "none (hardware.host_memory_gib is null)")  # fmt: skip
    lines = ["", f"host memory ({host.ranks_per_node} ranks per node), budget: {budget}"]
    seen: set[tuple[int, ...]] = set()
    for x in nodes:
        key = tuple(sorted(x.items.items()))  # type: ignore[arg-type]
        if key in seen:
            continue  # nodes of the same ranks' plans are alike: show each kind once
        seen.add(key)  # type: ignore[arg-type]
        span = f"{x.ranks[0]}-{x.ranks[-1]}" if len(x.ranks) > 1 else f"{x.ranks[0]}"
        verdict = ""
        if host.usable_bytes is not None and host.budget_bytes is not None:
            verdict = _verdict(host.usable_bytes - x.total_bytes,
                               host.budget_bytes - host.usable_bytes, "reserve")  # fmt: skip
        lines.append(f"node {x.node} (ranks {span}): peak {_size(x.total_bytes).strip()} at "
                     f"'{x.moment}'{verdict}")  # fmt: skip
        for name, size in sorted(x.items.items(), key=lambda kv: -kv[1]):
            if size:
                lines.append(f"  {name:<26} {_size(size)}  {HOST_ITEM_DOCS[name]}")
    return lines


def format_step_time(est: Any) -> str:
    """The step-time estimate (`flashcp.plan.steptime.StepTime`) as a few lines: model and
    executed FLOPs, the MFU stated and the hardware utilisation it implies, and the busiest
    stage's parts per micro-batch, which add up to the step."""
    lines = [
        "",
        f"step time: {_flop(est.flops)} of model FLOPs per step ({est.mask} attention), "
        f"{_flop(est.flops_per_device)} per device, {est.documents}: a token attends "
        f"{est.keys:,.0f} keys on average; "
        f"executed {_flop(est.executed_per_device)} per device ({est.executed_over_model:.2f}× "
        "the model FLOPs: recompute, tile re-runs, the attention backward at 2.5× its "
        "forward, the chunked loss's re-run)",
    ]
    if est.seconds_at_peak is None:
        lines.append("  no time estimate: set hardware.peak_tflops (TFLOP/s per device)")
        return "\n".join(lines)
    bubble = f", the pipeline idle {_pct(round(est.bubble, 2))} of it" if est.stages > 1 else ""
    reach = "" if est.hfu <= 1 else " — more than the hardware can: lower --mfu"
    lines.append(
        f"  at {est.peak_tflops:g} TFLOP/s per device and {_pct(est.mfu)} MFU (stated, not "
        f"measured), i.e. {_pct(round(est.hfu, 2))} of the peak in executed FLOPs{reach}: "
        f"~{_duration(est.seconds)} (>= {_duration(est.seconds_at_peak)} at 100 % MFU)"
        f"{bubble}"
    )
    layers = [x for x in est.parts if x.name.startswith("layer ")]
    others = [x for x in est.parts if not x.name.startswith("layer ")]
    if layers:
        first, last = layers[0], layers[-1]
        span = f"layers {first.index}-{last.index}" if len(layers) > 1 else first.name
        differ = len({round(x.seconds, 9) for x in layers}) > 1
        lines.append(
            f"  per micro-batch on the busiest stage's ranks: {span}: forward "
            f"{_duration(first.forward_s)}, backward {_duration(first.backward_s)} each"
            + (f" ({first.name}'s; they differ)" if differ else "")
            + "".join(f"; {x.name} {_duration(x.seconds)}" for x in others)
            + f"; × {est.micro_batches} micro-batch{'es' if est.micro_batches > 1 else ''} = "
            f"{_duration(est.micro_batches * sum(x.seconds for x in est.parts))} of compute"
        )  # fmt: skip
    copies = [x for x in layers if x.copy_bytes]
    if copies:
        x = copies[0]
        if x.copy_s is None:
            lines.append(f"  offload: {x.copy_bytes / 2**20:,.0f} MiB per layer each way; set "
                         "hardware.host_link_gb_per_s to compare it with the compute")  # fmt: skip
        else:
            verdict = ("hidden under the compute" if est.stall_s == 0
                       else f"STALLS the step by ~{_duration(est.stall_s)}")  # fmt: skip
            lines.append(
                f"  offload: {x.copy_bytes / 2**20:,.0f} MiB per layer each way at "
                f"{est.link_gb_per_s:g} GB/s = {_duration(x.copy_s)}, vs the layer's forward "
                f"{_duration(x.forward_s)} / backward {_duration(x.backward_s)}: {verdict}"
            )
    return "\n".join(lines)


def _flop(n: float) -> str:
    """FLOPs with a unit that keeps them readable: "2,189.3 PFLOP", "4.1 GFLOP"."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e6:,.1f} MFLOP"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _left(budget: int, peak: int, margin: float, key: str) -> str:
    """"8.70 GiB left, of which 4.80 GiB is the 5 % hardware.memory_headroom kept free"."""
    text = f"{_gib(budget - peak)} left"
    if margin:
        text += f", of which {_gib(budget * margin)} is the {_pct(margin)} hardware.{key} kept free"
    return text


def format_longest(result: Any, cfg: Config, *, source: str = "") -> str:
    """`flashcp plan --longest`'s text (`flashcp.plan.longest.Longest`)."""
    lines = [f"flashcp plan {source} --longest:"]
    if result.plan is None:
        lines.append(f"  not even data.seq_len={result.granularity} (one granule) fits")
    else:
        p = result.plan
        peak = p.peak
        lines.append(
            f"  longest data.seq_len: {result.seq_len:,} tokens (a multiple of "
            f"{result.granularity}), device peak {_gib(peak.total_bytes)} (rank {peak.rank}, "
            f"'{peak.moment}') of {_gib(p.budget_bytes or 0)}: "
            + _left(p.budget_bytes or 0, peak.total_bytes, p.headroom, "memory_headroom")
        )
        host = p.host
        if host is not None and (host.budget_bytes is not None or host.peak.total_bytes):
            node = host.peak
            of = ""
            if host.budget_bytes is not None:
                of = f" of {_gib(host.budget_bytes)}: " + _left(
                    host.budget_bytes, node.total_bytes, host.reserve, "host_memory_reserve")
            lines.append(f"  host peak {_gib(node.total_bytes)} per node ('{node.moment}'){of}")
        if result.without_margins is not None:
            lines.append(f"  without the margins (hardware.memory_headroom=0 "
                         f"hardware.host_memory_reserve=0): {result.without_margins:,} tokens, "
                         "fitting to the last byte")  # fmt: skip
    limit = result.to_json()["limit"]
    if limit is not None:
        budget = "device" if limit["budget"] == "device" else "host (per node)"
        over = _size(limit["peak_bytes"] - limit["usable_bytes"]).strip()
        lines.append(
            f"  {limit['seq_len']:,} does not fit the {budget} budget: "
            f"{_gib(limit['peak_bytes'])} at '{limit['moment']}', {over} over, largest item "
            f"{limit['largest_item']} {_gib(limit['item_bytes'])}"
        )
    elif result.limit == "max_seq_len":
        lines.append("  capped by model.max_seq_len (learned positions)")
    lines.append("  assumed (as the config has them; every other key too):")
    for key, value in result.assumed.items():
        if key == "capped_by_max_seq_len":
            continue
        lines.append(f"    {key}: {value}")
    lines.append(f"  ({result.plans} plans)")
    return "\n".join(lines)
