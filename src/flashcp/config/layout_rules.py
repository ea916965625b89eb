"""The layout rules of a `Config`: how the job is laid out over its processes and the sequence
over its cp ranks — the parallel degrees against the job (world size, nodes), expert and
pipeline parallelism, the CP mode and chunked attention, and the data.seq_len each layout
needs (a multiple of the CP mode's chunks, within model.max_seq_len).

Part of `flashcp.config.validate.check_config`; its fixes keep the lengths a changed layout
needs (`parallel.cp=3` comes with the data.seq_len it divides).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from flashcp.attention import registry as cp_modes
from flashcp.config.checks import Checks, positive
from flashcp.config.schema import Config


def _fit_length(cfg: Config, length: int, divisor: int) -> int:
    """The multiple of `divisor` nearest above `length`, or below it when above exceeds
    model.max_seq_len (and below is a sequence of >= 2 tokens)."""
    up = -(-length // divisor) * divisor
    max_len = getattr(cfg.model, "max_seq_len", None)
    down = length // divisor * divisor
    if isinstance(max_len, int) and up > max_len and down >= 2:
        return down
    return up


def _with_lengths(cfg: Config, fix: dict[str, Any]) -> dict[str, Any]:
    """`fix` plus what a changed parallel.cp / cp_mode needs: data.seq_len a multiple of the
    new divisor (unless parallel.pad), attention.kv_chunk a multiple of the new cp."""
    p = cfg.parallel
    cp, mode = fix.get("parallel.cp", p.cp), cp_modes.MODES.get(fix.get("parallel.cp_mode",
                                                                           p.cp_mode))  # fmt: skip
    out = dict(fix)
    if mode is None or cp < 1:
        return out
    divisor = cp * mode.chunks_per_rank
    if not p.pad and cfg.data.seq_len % divisor:
        out["data.seq_len"] = _fit_length(cfg, cfg.data.seq_len, divisor)
    kv = cfg.attention.kv_chunk
    if kv > 0 and kv % cp:
        out["attention.kv_chunk"] = -(-kv // cp) * cp
    return out


def _nearest(values: Iterable[int], target: int, n: int = 3) -> list[int]:
    """The `n` of `values` closest to `target` (ties: the smaller first), in that order."""
    return sorted(values, key=lambda v: (abs(v - target), v))[:n]


def check_parallel(cfg: Config, c: Checks, world_size: int | None, nnodes: int = 1) -> None:
    """The degrees (dp, pp, cp >= 1, ZeRO's sharding), dp·pp·cp against a job of
    `world_size` processes on `nnodes` nodes, then expert and pipeline parallelism."""
    p = cfg.parallel
    for dim in ("dp", "pp", "cp"):
        if getattr(p, dim) < 1:
            c.add(f"parallel.{dim}", f"must be an integer >= 1, got {getattr(p, dim)}")
    positive(c, "parallel.grad_bucket_mb", p.grad_bucket_mb)
    if p.shard_gradients and not p.shard_optimizer:
        c.add(
            "parallel.shard_gradients",
            "true shards the float32 gradients over the ranks that hold the optimizer's shards, "
            "but parallel.shard_optimizer is false (ZeRO-2 is ZeRO-1 plus sharded gradients)",
            "parallel.shard_optimizer",
            fixes=[{"parallel.shard_optimizer": True}, {"parallel.shard_gradients": False}],
        )
    if p.shard_optimizer and cfg.debug.dump_grads:
        c.add(
            "debug.dump_grads",
            "needs the full summed gradients, but under parallel.shard_optimizer: true each "
            "rank keeps only its shard of them",
            "parallel.shard_optimizer",
            fixes=[{"debug.dump_grads": False}, {"parallel.shard_optimizer": False}],
        )
    if not c.ok("parallel.dp", "parallel.pp", "parallel.cp"):
        return
    _check_ep(cfg, c)
    degrees = f"dp({p.dp}) × pp({p.pp}) × cp({p.cp}) = {p.world_size}"
    if world_size is not None and p.world_size != world_size:
        fixes = [
            _with_lengths(cfg, {f"parallel.{dim}": world_size // others})
            for dim, others in (("cp", p.dp * p.pp), ("dp", p.pp * p.cp))
            if world_size % others == 0
        ]
        job = f"{world_size} process{'es' if world_size != 1 else ''}"
        launch = f"--nproc_per_node {p.world_size}"
        if nnodes > 1:
            job += f" ({nnodes} nodes × {world_size // nnodes} per node)"
            launch = (
                f"--nnodes {nnodes} --nproc_per_node {p.world_size // nnodes}"
                if p.world_size % nnodes == 0
                else f"a node count that divides {p.world_size}"
            )
        c.add("parallel", f"{degrees} but the job has {job}", fixes=fixes,
              other=f"launch with {launch}")  # fmt: skip
    elif world_size is None and nnodes > 1 and p.world_size % nnodes:
        dp = p.dp * nnodes // math.gcd(p.world_size, nnodes)
        c.add(
            "parallel",
            f"{degrees} processes cannot be split over --nnodes {nnodes} nodes (dp·pp·cp must "
            f"equal nnodes × nproc_per_node, a multiple of {nnodes})",
            fixes=[{"parallel.dp": dp}],
            other="use another --nnodes",
        )
    _check_pipeline(cfg, c)


def _moe_archs() -> list[str]:
    from flashcp.models.families import FAMILIES

    return [arch for arch, fam in FAMILIES.items() if fam.is_moe]


def _check_ep(cfg: Config, c: Checks) -> None:
    """`parallel.ep`: divides dp × cp and model.num_experts, on a MoE model only."""
    p, m = cfg.parallel, cfg.model
    if isinstance(p.ep, bool) or not isinstance(p.ep, int) or p.ep < 1:
        c.add("parallel.ep", f"must be an integer >= 1, got {p.ep!r}")
        return
    if p.ep == 1:
        return
    if not getattr(m, "is_moe", False):
        c.add(
            "parallel.ep",
            f"parallel.ep={p.ep} splits the routed experts of a MoE model, but model.arch is "
            f"{getattr(m, 'arch', None)} (no experts)",
            "model.arch",
            fixes=[{"parallel.ep": 1}],
            other="use a MoE model (" + ", ".join(_moe_archs()) + ")",
        )
        return
    experts = getattr(m, "num_experts", None)
    fits = [
        d
        for d in range(1, p.dp * p.cp + 1)
        if (p.dp * p.cp) % d == 0 and (not isinstance(experts, int) or experts % max(d, 1) == 0)
    ]
    if (p.dp * p.cp) % p.ep:
        c.add(
            "parallel.ep",
            f"parallel.ep={p.ep} does not divide dp×cp={p.dp * p.cp} (parallel.dp={p.dp}, "
            f"parallel.cp={p.cp}): the expert-parallel groups are carved from the dp × cp "
            "ranks of a pipeline stage",
            fixes=[{"parallel.ep": d} for d in _nearest(fits, p.ep)],
        )
    if isinstance(experts, int) and experts > 0 and experts % p.ep:
        c.add(
            "parallel.ep",
            f"model.num_experts={experts} % parallel.ep={p.ep} = {experts % p.ep}: every ep "
            "rank holds the same number of experts",
            "model.num_experts",
            fixes=[{"parallel.ep": d} for d in _nearest(fits, p.ep)],
        )


def _check_pipeline(cfg: Config, c: Checks) -> None:
    """The layer split (`parallel.pp_layers`) and enough micro-batches for the schedule."""
    p = cfg.parallel
    layers = getattr(cfg.model, "num_layers", None)
    if p.pp_layers is not None and isinstance(layers, int) and c.ok("parallel.pp_layers"):
        from flashcp.pipeline.split import split_layers

        try:
            split_layers(layers, p.pp, p.pp_layers)
        except ValueError as exc:
            c.add("parallel.pp_layers", str(exc), "model.num_layers",
                  fixes=[{"parallel.pp_layers": None}])  # fmt: skip
    if p.pp > 1 and cfg.train.grad_accum < p.pp:
        c.add(
            "train.grad_accum",
            f"{cfg.train.grad_accum} micro-batches cannot fill a {p.pp_schedule} pipeline of "
            f"parallel.pp = {p.pp} stages (train.grad_accum >= {p.pp}: the micro-batches per "
            "step; more shrink the pipeline bubble)",
            "parallel.pp",
            fixes=[{"train.grad_accum": p.pp}],
        )


def check_cp_mode(cfg: Config, c: Checks) -> None:
    """`parallel.cp_mode` names a mode of the one registry (`flashcp.attention.registry`)."""
    mode = cfg.parallel.cp_mode
    if mode not in cp_modes.MODES:
        modes = ", ".join(repr(name) for name in cp_modes.names())
        c.add("parallel.cp_mode", f"expected one of {modes}, got {mode!r}")


def check_attention(cfg: Config, c: Checks) -> None:
    """`attention.query_chunk` / `attention.kv_chunk`: >= 0, kv_chunk a multiple of cp, and a
    CP mode with a chunked implementation (`flashcp.attention.registry`)."""
    a, p = cfg.attention, cfg.parallel
    for key in ("query_chunk", "kv_chunk"):
        value = getattr(a, key)
        if value < 0:
            c.add(f"attention.{key}", f"must be an integer >= 0 (0 = one chunk), got {value}")
    if p.cp >= 1 and a.kv_chunk > 0 and a.kv_chunk % p.cp and c.ok("parallel.cp"):
        up = -(-a.kv_chunk // p.cp) * p.cp
        c.add(
            "attention.kv_chunk",
            f"{a.kv_chunk} is not a multiple of parallel.cp = {p.cp}: each cp rank contributes "
            "kv_chunk / cp of its rows to a gathered key chunk",
            "parallel.cp",
            fixes=[{"attention.kv_chunk": up}],
        )
    chunked = a.query_chunk > 0 or a.kv_chunk > 0
    mode = cp_modes.MODES.get(p.cp_mode)
    if chunked and mode is not None and mode.chunked_implementation is None:
        chunked_modes = [n for n, m in cp_modes.MODES.items() if m.chunked_implementation]
        c.add(
            "attention.query_chunk",
            f"chunked attention (attention.query_chunk {a.query_chunk}, attention.kv_chunk "
            f"{a.kv_chunk}) has no implementation for parallel.cp_mode {p.cp_mode}",
            "parallel.cp_mode",
            fixes=[
                {"attention.query_chunk": 0, "attention.kv_chunk": 0},
                *(_with_lengths(cfg, {"parallel.cp_mode": n}) for n in chunked_modes[:2]),
            ],
        )


def check_lengths(cfg: Config, c: Checks) -> None:
    """data.seq_len (and the micro-batch size, balance window): a multiple of the CP mode's
    chunks (unless parallel.pad), within model.max_seq_len once padded."""
    d, p, m = cfg.data, cfg.parallel, cfg.model
    if d.seq_len < 2:
        c.add("data.seq_len", f"must be >= 2 (a sequence needs a next token), got {d.seq_len}")
        return
    if d.micro_batch_size < 1:
        c.add("data.micro_batch_size", f"must be >= 1, got {d.micro_batch_size}")
    if d.balance_window < 1:
        c.add("data.balance_window", f"must be >= 1 (steps), got {d.balance_window}")
    if p.cp < 1:
        return
    length = d.seq_len
    chunks = cp_modes.MODES[p.cp_mode].chunks_per_rank if c.ok("parallel.cp_mode") else 0
    divisor = p.cp * chunks
    if chunks and d.seq_len % divisor:
        up = -(-d.seq_len // divisor) * divisor
        if p.pad:
            length = up
        else:
            how = "cp" if chunks == 1 else f"{chunks}·cp"
            c.add(
                "data.seq_len",
                f"{d.seq_len} is not a multiple of {how} = {divisor} (parallel.cp_mode "
                f"{p.cp_mode}, parallel.cp {p.cp})",
                "parallel.cp",
                "parallel.cp_mode",
                fixes=[{"data.seq_len": _fit_length(cfg, d.seq_len, divisor)},
                       {"parallel.pad": True}],  # fmt: skip
            )
    max_len = getattr(m, "max_seq_len", None)
    if isinstance(max_len, int) and length > max_len:
        what = f"data.seq_len {d.seq_len}" + (f" (padded to {length})" if length != d.seq_len
                                              else "")  # fmt: skip
        lower = max_len // divisor * divisor if chunks else max_len
        c.add(
            "data.seq_len",
            f"{what} exceeds model.max_seq_len {max_len}",
            "model.max_seq_len",
            # a from_pretrained model's max_seq_len is its config.json's: that fix is pruned
            fixes=[{"data.seq_len": lower}, {"model.max_seq_len": length}],
        )
