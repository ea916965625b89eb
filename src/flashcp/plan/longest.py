"""The longest `data.seq_len` a config fits, by its memory plan (`flashcp plan --longest`).

Everything but the sequence length stays as the config says (layout, micro-batch size,
gradient accumulation, recompute, dtypes, the long-context mechanisms `features_of` reads):
the search plans candidate lengths and keeps the longest that fits BOTH budgets, the device
one (`hardware.memory_gib` or `--device-memory`) on every rank and the host one
(`hardware.host_memory_gib`) on every node. Candidates are multiples of the granularity: the
layout's, `parallel.cp` × the CP mode's chunks per rank (`flashcp.attention.registry`); the
tiles and attention chunks of the mechanisms need not divide anything (the last is shorter).

Both budgets keep their margins (`hardware.memory_headroom` of the device memory,
`hardware.host_memory_reserve` of the host's): the answer leaves them free. The search runs
once more without them, so the answer also says what fits to the last byte (an upper bound,
not a length to train at).

A rank's planned bytes grow with the sequence, so fitting is monotone in it: the search
doubles from one granule until a candidate does not fit, then bisects over the multiples in
between — about 2·log2(longest / granule) plans, well under a second for GLM-4-9B.

With rotary positions the model's `max_seq_len` only bounds the data (the checkpoint's
config.json states it), so it is raised with the candidate and reported as an assumption; with
learned positions it sizes a parameter, so it caps the search instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flashcp.attention import registry as cp_modes
from flashcp.config.device_rule import compute_dtype, resolve_device
from flashcp.config.schema import Config
from flashcp.plan.features import Features, features_of
from flashcp.plan.model import GIB, Plan, plan, ranks_per_node

SEARCH_LIMIT = 2**36
"""The longest sequence the search tries (tokens), far beyond any device today."""


@dataclass
class Longest:
    """The search's answer: the longest fitting length (0: not even one granule fits), its
    plan, the granularity, what limited it, and the settings assumed."""

    seq_len: int
    granularity: int
    plan: Plan | None
    """The plan at `seq_len` (None when nothing fits)."""
    next_plan: Plan | None
    """The plan one granule longer: what does not fit there."""
    assumed: dict[str, Any]
    plans: int
    """Candidates planned."""
    without_margins: int | None = None
    """The longest length that fits with no margin kept (None: the margins are 0, or this is
    that search)."""

    @property
    def limit(self) -> str | None:
        """Which budget the next granule breaks: "device", "host", "max_seq_len" or None."""
        nxt = self.next_plan
        if nxt is None:
            return "max_seq_len" if self.assumed.get("capped_by_max_seq_len") else None
        if not nxt.device_fits:
            return "device"
        return "host" if not nxt.host_fits else None

    def to_json(self) -> dict[str, Any]:
        nxt = self.next_plan
        limit: dict[str, Any] | None = None
        if nxt is not None:
            if not nxt.device_fits:
                worst = nxt.peak
                name, size = worst.largest_item()
                limit = {"budget": "device", "seq_len": self.seq_len + self.granularity,
                         "peak_bytes": worst.total_bytes, "usable_bytes": nxt.usable_bytes,
                         "rank": worst.rank,
                         "moment": worst.moment, "largest_item": name, "item_bytes": size}
            elif nxt.host is not None and not nxt.host.fits:
                node = nxt.host.peak
                name, size = node.largest_item()
                limit = {"budget": "host", "seq_len": self.seq_len + self.granularity,
                         "peak_bytes": node.total_bytes, "usable_bytes": nxt.host.usable_bytes,
                         "node": node.node,
                         "moment": node.moment, "largest_item": name, "item_bytes": size}
        return {
            "longest_seq_len": self.seq_len,
            "without_margins_seq_len": self.without_margins,
            "granularity": self.granularity,
            "assumed": self.assumed,
            "limit": limit,
            "plans": self.plans,
            "plan": self.plan.to_json() if self.plan is not None else None,
        }  # fmt: skip


def granularity(cfg: Config) -> int:
    """What `data.seq_len` must be a multiple of: cp × chunks per rank of the CP mode. (Tiles
    and attention chunks need not divide anything: the last one is shorter.)"""
    p = cfg.parallel
    return p.cp * cp_modes.get(p.cp_mode).chunks_per_rank


def with_seq_len(cfg: Config, seq_len: int) -> Config:
    """`cfg` at `seq_len` tokens per sequence (rotary models: `max_seq_len` raised to it)."""
    model = cfg.model
    if not model.uses_learned_positions and model.max_seq_len < seq_len:
        model = dataclasses.replace(model, max_seq_len=seq_len)
    return dataclasses.replace(
        cfg, model=model, data=dataclasses.replace(cfg.data, seq_len=seq_len)
    )


def longest(
    cfg: Config,
    *,
    device: str | None = None,
    budget_gib: float | None = None,
    host_budget_gib: float | None = None,
    features: Features | None = None,
    nnodes: int | None = None,
    margins: bool = True,
) -> Longest:
    """The longest `data.seq_len` of `cfg` whose plan fits (module docstring); the budgets
    default as `flashcp.plan.plan`'s do, and keep their margins unless `margins` is False
    (then the answer fits to the last byte). `ValueError` without a device budget."""
    gib = budget_gib if budget_gib is not None else cfg.hardware.memory_gib
    if gib is None:
        raise ValueError(
            "the longest sequence needs a device budget: set hardware.memory_gib (or "
            "--device-memory GiB)"
        )
    f = features_of(cfg) if features is None else features
    found = _search(cfg, device, gib, host_budget_gib, f, nnodes, margins)
    hw = cfg.hardware
    if margins and (hw.memory_headroom or hw.host_memory_reserve):
        start = found.seq_len // found.granularity  # fits without the margins too
        found.without_margins = _search(cfg, device, gib, host_budget_gib, f, nnodes, False,
                                        start).seq_len  # fmt: skip
    return found


def _search(
    cfg: Config,
    device: str | None,
    gib: float,
    host_budget_gib: float | None,
    f: Features,
    nnodes: int | None,
    margins: bool,
    start: int = 1,
) -> Longest:
    """`longest`'s search at one setting of the margins, doubling from `start` granules (a
    length known to fit: the answer with margins, for the search without them)."""
    step = granularity(cfg)
    cap = SEARCH_LIMIT
    capped = cfg.model.uses_learned_positions
    if capped:
        cap = min(cap, cfg.model.max_seq_len)
    count = 0

    def attempt(n: int) -> Plan:
        nonlocal count
        count += 1
        return plan(with_seq_len(cfg, n), device=device, budget_gib=gib,
                    host_budget_gib=host_budget_gib, features=f, nnodes=nnodes,
                    margins=margins)  # fmt: skip

    best: tuple[int, Plan] | None = None
    bad: tuple[int, Plan] | None = None
    k = max(1, start)
    while k * step <= cap:
        p = attempt(k * step)
        if not p.fits:
            bad = (k, p)
            break
        best = (k, p)
        k *= 2
    if best is not None and bad is not None:
        lo, hi = best[0], bad[0]  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = attempt(mid * step)
            if p.fits:
                lo, best = mid, (mid, p)
            else:
                hi, bad = mid, (mid, p)
    elif best is not None and cap // step > best[0]:  # doubling ran into the cap: bisect up
        lo, hi = best[0], cap // step + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = attempt(mid * step)
            if p.fits:
                lo, best = mid, (mid, p)
            else:
                hi, bad = mid, (mid, p)
    seq = best[0] * step if best is not None else 0
    nxt = bad[1] if bad is not None and bad[0] * step == seq + step else None
    if nxt is None and best is not None and (seq + step) <= cap:
        nxt = attempt(seq + step)
    assumed = _assumed(cfg, f, seq, gib, host_budget_gib, nnodes, device, margins)
    assumed["capped_by_max_seq_len"] = bool(capped and seq + step > cap)
    return Longest(seq, step, best[1] if best is not None else None, nxt, assumed, count)


def _assumed(
    cfg: Config,
    f: Features,
    seq: int,
    gib: float,
    host_gib: float | None,
    nnodes: int | None,
    device: str | None,
    margins: bool = True,
) -> dict[str, Any]:
    """The settings the answer holds for (everything but data.seq_len, as the config has it)."""
    p, d, t, m, hw = cfg.parallel, cfg.data, cfg.train, cfg.model, cfg.hardware
    dev = device or resolve_device(cfg)
    host = host_gib if host_gib is not None else cfg.hardware.host_memory_gib
    out: dict[str, Any] = {
        "layout": f"dp {p.dp} × pp {p.pp} × cp {p.cp}" + (f" (ep {p.ep})" if p.ep > 1 else ""),
        "parallel.cp_mode": p.cp_mode,
        "data.micro_batch_size": d.micro_batch_size,
        "train.grad_accum": t.grad_accum,
        "model.recompute": m.recompute,
        "device": dev,
        "compute_dtype": compute_dtype(cfg, dev, check=False),
        "train.param_dtype": t.param_dtype,
        "parallel.shard_optimizer": p.shard_optimizer,
        "train.loss_chunk_tokens": t.loss_chunk_tokens,
        "device_budget_gib": gib,
        "hardware.memory_headroom": hw.memory_headroom if margins else 0.0,
        "host_budget_gib": host,
        "hardware.host_memory_reserve": hw.host_memory_reserve if margins else 0.0,
        "ranks_per_node": ranks_per_node(cfg, nnodes),
        "features": f.overrides(),
    }
    if not m.uses_learned_positions and seq > m.max_seq_len:
        out["model.max_seq_len"] = (
            f"{m.max_seq_len} raised to {seq}: rotary positions, the limit is the checkpoint's "
            "config.json (max_position_embeddings), which a long-context run must cover"
        )
    return out


__all__ = ["GIB", "Longest", "granularity", "longest", "with_seq_len"]
